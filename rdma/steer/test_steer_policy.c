/* test_steer_policy: every decision of lp_steer_policy.c (tests/unit/test_steer_shim.py builds and
 * runs it). Prints "ok N" and exits 0, or names the failed check and exits 1. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lp_steer_policy.h"

static int checks;
#define CHECK(cond) do { checks++; if (!(cond)) { printf("FAILED %s:%d: %s\n", __FILE__, __LINE__, #cond); exit(1); } } while (0)

int main(void) {
    /* every guard, in order: a call that passes all of them, then each one failing alone */
    const struct lps_call all = {.to_rtr = 1, .rc = 1, .grh = 1, .flow_label = 0, .override = 0, .roce_v2 = 1,
                                 .table_ok = 1, .have_entry = 1, .nports = 4};
    CHECK(lps_judge(&all) == LPS_STEERED);
    struct lps_call c;
    c = all; c.to_rtr = 0; CHECK(lps_judge(&c) == LPS_NOT_RTR);
    c = all; c.rc = 0; CHECK(lps_judge(&c) == LPS_NOT_RC);
    c = all; c.grh = 0; CHECK(lps_judge(&c) == LPS_NO_GRH);
    c = all; c.flow_label = 0x1234; CHECK(lps_judge(&c) == LPS_APP_LABEL);
    c = all; c.flow_label = 0x1234; c.override = 1; CHECK(lps_judge(&c) == LPS_STEERED);
    c = all; c.roce_v2 = 0; CHECK(lps_judge(&c) == LPS_NOT_ROCE_V2);
    c = all; c.table_ok = 0; CHECK(lps_judge(&c) == LPS_NO_TABLE);
    c = all; c.have_entry = 0; CHECK(lps_judge(&c) == LPS_NOT_LINKPASS);
    c = all; c.nports = 0; CHECK(lps_judge(&c) == LPS_NO_PORT);
    /* the cheapest guard decides when several fail: a non-RTR call is never asked about the table */
    const struct lps_call none = {0};
    CHECK(lps_judge(&none) == LPS_NOT_RTR);
    c = none; c.to_rtr = 1; c.rc = 1; CHECK(lps_judge(&c) == LPS_NO_GRH);
    c = all; c.roce_v2 = 0; c.table_ok = 0; CHECK(lps_judge(&c) == LPS_NOT_ROCE_V2);
    for (int v = 0; v < LPS_NVERDICTS; v++) CHECK(lps_verdict_name[v] != NULL && lps_verdict_name[v][0] != 0);

    /* turns: distinct paths first, then around again; nothing to pick from an empty set */
    CHECK(lps_pick(4, 0) == 0 && lps_pick(4, 1) == 1 && lps_pick(4, 3) == 3 && lps_pick(4, 4) == 0);
    CHECK(lps_pick(1, 7) == 0 && lps_pick(0, 0) == -1 && lps_pick(-1, 3) == -1);
    CHECK(lps_pick(3, 0xFFFFFFFFFFFFFFFFull) == (int)(0xFFFFFFFFFFFFFFFFull % 3));
    int seen[8] = {0};
    for (uint64_t t = 0; t < 8; t++) seen[lps_pick(8, t)]++;
    for (int i = 0; i < 8; i++) CHECK(seen[i] == 1); /* 8 QPs over 8 paths: one each */

    /* GIDs to the table's address keys */
    uint8_t gid[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 198, 18, 72, 1}, addr[16];
    CHECK(lps_gid_address(gid, addr) == 4);
    CHECK(addr[0] == 198 && addr[1] == 18 && addr[2] == 72 && addr[3] == 1);
    for (int i = 4; i < 16; i++) CHECK(addr[i] == 0);
    uint8_t v6[16] = {0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2};
    CHECK(lps_gid_address(v6, addr) == 6 && memcmp(addr, v6, 16) == 0);
    uint8_t almost[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xfe, 1, 2, 3, 4}; /* not the mapped prefix */
    CHECK(lps_gid_address(almost, addr) == 6 && memcmp(addr, almost, 16) == 0);

    printf("ok %d\n", checks);
    return 0;
}
