/* lp_policy.c: see lp_policy.h. */
#include "lp_policy.h"

#include <stddef.h>

const char *const lp_lane_state_name[LP_NSTATES] = {"down", "connecting", "hello", "live"};

static const signed char NEXT[LP_NSTATES][LP_NEVENTS] = {
    /*                 HOLD_OVER      CONNECTED  HELLO_OK  FAIL    */
    [LP_DOWN] =       {LP_CONNECTING, -1,        -1,       LP_DOWN}, /* a connect that fails at once */
    [LP_CONNECTING] = {-1,            LP_HELLO,  -1,       LP_DOWN},
    [LP_HELLO] =      {-1,            -1,        LP_LIVE,  LP_DOWN},
    [LP_LIVE] =       {-1,            -1,        -1,       LP_DOWN},
};

int lp_lane_next(int state, int event) {
    if (state < 0 || state >= LP_NSTATES || event < 0 || event >= LP_NEVENTS) return -1;
    return NEXT[state][event];
}

uint64_t lp_hold_ns(int penalty) {
    if (penalty <= 1) return 0;
    int shift = penalty - 2 < 7 ? penalty - 2 : 7;
    uint64_t h = LP_HOLD_STEP_NS << shift;
    return h < LP_HOLD_MAX_NS ? h : LP_HOLD_MAX_NS;
}

uint64_t lp_health_down(struct lp_health *h, uint64_t now) {
    if (h->penalty < 1000) h->penalty++;
    return now + lp_hold_ns(h->penalty);
}

void lp_health_up(struct lp_health *h, uint64_t now) { h->last_decay_ns = now; }

void lp_health_tick(struct lp_health *h, uint64_t now) {
    if (h->penalty && now - h->last_decay_ns >= LP_DECAY_NS) {
        h->penalty--;
        h->last_decay_ns = now;
    }
}

void lp_health_rtt(struct lp_health *h, uint64_t rtt_ns) {
    h->srtt_ns = h->srtt_ns ? (7 * h->srtt_ns + rtt_ns) / 8 : rtt_ns;
}

uint64_t lp_stuck_bound(const struct lp_health *h, uint64_t stuck_min_ns, int carrying_data) {
    uint64_t b = 8 * h->srtt_ns;
    if (b < stuck_min_ns) b = stuck_min_ns;
    if (!carrying_data && b < LP_IDLE_BOUND_NS) b = LP_IDLE_BOUND_NS; /* a false alarm there costs a reconnect only */
    return b;
}

int lp_pick_plane(int own, int nplanes, const int *avoid, const int *usable, const int *live) {
    for (int pass = 0; pass < 3; pass++)
        for (int k = 0; k < nplanes; k++) {
            int q = k == 0 ? own : (k <= own ? k - 1 : k);
            if (q < 0 || q >= nplanes) continue;
            if (pass == 0 && avoid[q]) continue;
            if (pass < 2 ? usable[q] > 0 : live[q] > 0) return q;
        }
    return -1;
}
