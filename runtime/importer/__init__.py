"""Import: the FX graph as a TOSA module, one generated lowering per node (the registry rendered
from opdefs/*.yaml, the rule builtins it calls, the TOSA builder), checked against a target."""
