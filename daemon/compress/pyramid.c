/* PyramidKV's layer schedule (KVCache-Factory): budgets fall linearly from the first layer to
 * the last around the average B, the window kept on top of each. */
#include "daemon/compress/compress.h"

void skv_pyramid_budgets(int n_layers, int budget, int window, int beta, int n, int *out)
{
    if (n_layers == 1) { /* no schedule to spread over (the reference divides by zero): B */
        out[0] = budget < n ? budget : n;
        return;
    }
    if (window > budget)
        window = budget;
    int avg = budget - window; /* selectable prefix entries per layer on average */
    if (n < 2 * avg) { /* as the reference: a prompt below the budget kept whole, one below twice
                        * the selectable share cut to the same budget in every layer */
        for (int l = 0; l < n_layers; l++)
            out[l] = budget < n ? budget : n;
        return;
    }
    int min_num = avg / beta;
    int max_num = avg * 2 - min_num;
    if (max_num >= n - window) {
        max_num = n - window;
        min_num = avg * 2 - max_num;
    }
    int steps = n_layers > 1 ? (max_num - min_num) / (n_layers - 1) : 0;
    for (int l = 0; l < n_layers; l++) {
        int b = max_num - l * steps + window;
        out[l] = b < 1 ? 1 : b > n ? n : b;
    }
}
