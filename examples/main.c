/* Runs the MLP of mlp.so (written by export_mlp.py) on deterministic inputs and prints its
 * outputs, each as a line "name [shape]" and then one line per row. Build and run: make run. */
#include <stdio.h>

#include "mlp.h"

static void print_tensor(const char *name, const float *data, const int64_t *shape, int rank)
{
    int64_t n = 1, row = rank ? shape[rank - 1] : 1;
    printf("%s [", name);
    for (int d = 0; d < rank; ++d) {
        printf(d ? ", %lld" : "%lld", (long long)shape[d]);
        n *= shape[d];
    }
    printf("]\n");
    for (int64_t i = 0; i < n; ++i)
        printf((i + 1) % row ? "%.9g " : "%.9g\n", data[i]);
}

int main(void)
{
    static float features[MLP_FEATURES_NUMEL];
    static int64_t token_ids[MLP_TOKEN_IDS_NUMEL];
    static float logits[MLP_LOGITS_NUMEL], probs[MLP_PROBS_NUMEL];

    for (int i = 0; i < MLP_FEATURES_NUMEL; ++i)
        features[i] = (float)((i * 37) % 17 - 8) / 8.0f;
    for (int i = 0; i < MLP_TOKEN_IDS_NUMEL; ++i)
        token_ids[i] = (i * 7 + 3) % 50; /* VOCAB of export_mlp.py */

    int status = mlp_run(features, token_ids, logits, probs);
    if (status != MLP_OK) {
        fprintf(stderr, "mlp_run failed with status %d\n", status);
        return 1;
    }
    print_tensor("logits", logits, MLP_LOGITS_SHAPE, MLP_LOGITS_RANK);
    print_tensor("probs", probs, MLP_PROBS_SHAPE, MLP_PROBS_RANK);
    return 0;
}
