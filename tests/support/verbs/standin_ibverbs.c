/* A stand-in for libibverbs' ibv_modify_qp, for the steering shim's unit tests
 * (tests/unit/test_steer_shim.py): it records each call's QP number, target state, mask and GRH
 * flow label, one line per call, to the file named by STANDIN_LOG, and returns 0. With
 * STANDIN_REFUSE_LABELS=1 it refuses (EINVAL) every call that carries a flow label, as a driver
 * could refuse a label it does not support. Built with the real library's symbol version
 * (IBVERBS_1.1), so the shim finds it the way it finds libibverbs. The real verbs path runs in the
 * Soft-RoCE guests. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <infiniband/verbs.h>

int ibv_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask) {
    const char *refuse = getenv("STANDIN_REFUSE_LABELS");
    int refused = refuse && strcmp(refuse, "1") == 0 && (attr_mask & IBV_QP_AV) && attr->ah_attr.grh.flow_label != 0;
    const char *path = getenv("STANDIN_LOG");
    FILE *f = path ? fopen(path, "a") : NULL;
    if (f) {
        fprintf(f, "qp=%u state=%d mask=0x%x flow_label=%u rc=%d\n", qp->qp_num, (int)attr->qp_state, attr_mask,
                (unsigned)attr->ah_attr.grh.flow_label, refused ? EINVAL : 0);
        fclose(f);
    }
    return refused ? EINVAL : 0;
}
