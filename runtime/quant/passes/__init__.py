"""Graph passes over a captured quantized FX graph (run before import): the matcher that puts
group ops in place of PT2E's node groups, integer edges, uint8 pairs as int8."""
