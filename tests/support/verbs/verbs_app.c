/* A verbs "application" for the steering shim's unit tests: it makes QP transitions through
 * ibv_modify_qp as an RDMA program would, on QPs of a named device, against the stand-in library
 * (standin_ibverbs.c) it is linked with. Prints each call's return code.
 *
 *   verbs_app DEV COUNT rc|ud rtr|rts GRH(0|1) FLOW_LABEL PEER_ADDR SGID_INDEX
 */
#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <infiniband/verbs.h>

int main(int argc, char **argv) {
    if (argc != 9) {
        fprintf(stderr, "usage: verbs_app DEV COUNT rc|ud rtr|rts GRH FLOW_LABEL PEER_ADDR SGID_INDEX\n");
        return 2;
    }
    struct ibv_device dev;
    memset(&dev, 0, sizeof dev);
    snprintf(dev.name, sizeof dev.name, "%s", argv[1]);
    struct ibv_context ctx;
    memset(&ctx, 0, sizeof ctx);
    ctx.device = &dev;
    int count = atoi(argv[2]);
    for (int i = 0; i < count; i++) {
        struct ibv_qp qp;
        memset(&qp, 0, sizeof qp);
        qp.context = &ctx;
        qp.qp_num = 100 + (uint32_t)i;
        qp.qp_type = strcmp(argv[3], "rc") == 0 ? IBV_QPT_RC : IBV_QPT_UD;
        struct ibv_qp_attr a;
        memset(&a, 0, sizeof a);
        a.qp_state = strcmp(argv[4], "rtr") == 0 ? IBV_QPS_RTR : IBV_QPS_RTS;
        a.ah_attr.is_global = (uint8_t)atoi(argv[5]);
        a.ah_attr.grh.flow_label = (uint32_t)strtoul(argv[6], NULL, 0);
        a.ah_attr.grh.sgid_index = (uint8_t)atoi(argv[8]);
        a.ah_attr.port_num = 1;
        struct in_addr v4;
        if (inet_pton(AF_INET, argv[7], &v4) == 1) {
            a.ah_attr.grh.dgid.raw[10] = 0xff;
            a.ah_attr.grh.dgid.raw[11] = 0xff;
            memcpy(a.ah_attr.grh.dgid.raw + 12, &v4, 4);
        } else if (inet_pton(AF_INET6, argv[7], a.ah_attr.grh.dgid.raw) != 1) {
            fprintf(stderr, "not an address: %s\n", argv[7]);
            return 2;
        }
        int mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
        printf("%d\n", ibv_modify_qp(&qp, &a, mask));
    }
    return 0;
}
