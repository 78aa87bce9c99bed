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

uint16_t lp_sport_of_flow_label(uint32_t flow_label) {
    uint32_t fl = flow_label & 0xFFFFFu;
    return (uint16_t)(LP_SPORT_MIN | ((fl & 0x3FFFu) ^ ((fl & 0xFC000u) >> 14)));
}

uint32_t lp_flow_label_for_sport(uint16_t sport) {
    if (sport < LP_SPORT_MIN) return 0;
    uint32_t low = sport & 0x3FFFu;
    return low ? low : (1u << 14) | 1u; /* 0xC000: a set high bit cancels its own low bit */
}

int lp_port_verdict(const uint16_t *healthy, int nhealthy, int have_entry, int fail_static, uint16_t port) {
    if (!have_entry || fail_static || nhealthy <= 0) return LP_PORT_KEEP;
    for (int i = 0; i < nhealthy; i++)
        if (healthy[i] == port) return LP_PORT_KEEP;
    return LP_PORT_LEFT;
}

static int uses(const uint16_t *used, int nused, uint16_t port) {
    int k = 0;
    for (int i = 0; i < nused; i++) k += used[i] == port;
    return k;
}

uint16_t lp_pick_port(const uint16_t *healthy, int nhealthy, const uint16_t *used, int nused, uint16_t prev,
                      unsigned key, uint16_t fallback) {
    if (nhealthy <= 0) return fallback;
    int best = -1, best_uses = 0;
    for (int pass = 0; pass < 2 && best < 0; pass++) /* pass 0 skips prev, pass 1 takes it */
        for (int k = 0; k < nhealthy; k++) {
            int i = (int)((key + (unsigned)k) % (unsigned)nhealthy);
            if (pass == 0 && healthy[i] == prev && nhealthy > 1) continue;
            int u = uses(used, nused, healthy[i]);
            if (best < 0 || u < best_uses) { best = i; best_uses = u; }
        }
    return healthy[best];
}

int lp_pick_rebalance(const uint16_t *ports, int nlanes, const uint16_t *healthy, int nhealthy) {
    if (nhealthy <= 1 || nlanes <= 1) return -1;
    int least = -1, most_lane = -1, most = -1;
    for (int i = 0; i < nhealthy; i++) {
        int u = uses(ports, nlanes, healthy[i]);
        if (least < 0 || u < least) least = u;
    }
    for (int j = 0; j < nlanes; j++) {
        int healthy_port = 0;
        for (int i = 0; i < nhealthy; i++) healthy_port |= healthy[i] == ports[j];
        if (!healthy_port) continue; /* lanes on ports that left are moved by lp_port_verdict */
        int u = uses(ports, nlanes, ports[j]);
        if (u > most) { most = u; most_lane = j; }
    }
    return most_lane >= 0 && most - least >= 2 ? most_lane : -1;
}
