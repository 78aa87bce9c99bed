/* lp_steer_policy.c: the steering shim's pure decisions (lp_steer_policy.h). */
#include "lp_steer_policy.h"

#include <string.h>

const char *const lps_verdict_name[LPS_NVERDICTS] = {
    "steered", "not_rtr", "not_rc", "no_grh", "app_label", "not_roce_v2", "no_table", "not_linkpass", "no_port",
};

enum lps_verdict lps_judge(const struct lps_call *c) {
    if (!c->to_rtr) return LPS_NOT_RTR;
    if (!c->rc) return LPS_NOT_RC;
    if (!c->grh) return LPS_NO_GRH;
    if (c->flow_label != 0 && !c->override) return LPS_APP_LABEL;
    if (!c->roce_v2) return LPS_NOT_ROCE_V2;
    if (!c->table_ok) return LPS_NO_TABLE;
    if (!c->have_entry) return LPS_NOT_LINKPASS;
    if (c->nports <= 0) return LPS_NO_PORT;
    return LPS_STEERED;
}

int lps_pick(int nports, uint64_t turn) {
    return nports > 0 ? (int)(turn % (uint64_t)nports) : -1;
}

int lps_gid_address(const uint8_t gid[16], uint8_t addr[16]) {
    static const uint8_t v4_prefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    memset(addr, 0, 16);
    if (memcmp(gid, v4_prefix, sizeof v4_prefix) == 0) {
        memcpy(addr, gid + 12, 4);
        return 4;
    }
    memcpy(addr, gid, 16);
    return 6;
}
