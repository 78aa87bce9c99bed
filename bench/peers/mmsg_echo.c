/*
 * The peer for bench/probe_core.py: the least work a UDP round trip can cost.
 * `mmsg_echo server ADDR PORT SECONDS` echoes every datagram back (recvmmsg/sendmmsg batches);
 * `mmsg_echo client SRC DST PORT SECONDS SIZE` keeps a window of datagrams in flight and counts
 * round trips. No authentication, no timestamps, no statistics: a floor, not a competitor.
 * Each prints "roundtrips N cpu_s X" (client) or "echoed N cpu_s X" (server) on exit.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define BATCH 32
#define SIZE_MAX_ 9000

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec / 1e9; }
static double cpu(void) {
    struct rusage r; getrusage(RUSAGE_SELF, &r);
    return r.ru_utime.tv_sec + r.ru_utime.tv_usec / 1e6 + r.ru_stime.tv_sec + r.ru_stime.tv_usec / 1e6;
}

int main(int argc, char **argv) {
    if (argc < 5) { fprintf(stderr, "usage: server ADDR PORT SECONDS | client SRC DST PORT SECONDS SIZE\n"); return 2; }
    int server = strcmp(argv[1], "server") == 0;
    int fd = socket(AF_INET, SOCK_DGRAM, 0);
    struct sockaddr_in me = {.sin_family = AF_INET}, peer = {.sin_family = AF_INET};
    inet_pton(AF_INET, argv[2], &me.sin_addr);
    int port = atoi(server ? argv[3] : argv[4]);
    double seconds = atof(server ? argv[4] : argv[5]);
    int size = server ? 0 : atoi(argv[6]);
    if (server) me.sin_port = htons(port);
    if (bind(fd, (struct sockaddr *)&me, sizeof me) < 0) { perror("bind"); return 1; }
    if (!server) { inet_pton(AF_INET, argv[3], &peer.sin_addr); peer.sin_port = htons(port); }
    static char bufs[BATCH][SIZE_MAX_];
    struct mmsghdr msgs[BATCH];
    struct iovec iov[BATCH];
    struct sockaddr_in from[BATCH];
    long long count = 0;
    double end = now() + seconds, c0 = cpu();
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    while (now() < end) {
        if (!server) { /* send a batch, then collect what comes back */
            for (int i = 0; i < BATCH; i++) {
                iov[i].iov_base = bufs[i]; iov[i].iov_len = size;
                memset(&msgs[i], 0, sizeof msgs[i]);
                msgs[i].msg_hdr.msg_name = &peer; msgs[i].msg_hdr.msg_namelen = sizeof peer;
                msgs[i].msg_hdr.msg_iov = &iov[i]; msgs[i].msg_hdr.msg_iovlen = 1;
            }
            sendmmsg(fd, msgs, BATCH, 0);
        }
        if (poll(&pfd, 1, 10) <= 0) continue;
        for (int i = 0; i < BATCH; i++) {
            iov[i].iov_base = bufs[i]; iov[i].iov_len = SIZE_MAX_;
            memset(&msgs[i], 0, sizeof msgs[i]);
            msgs[i].msg_hdr.msg_name = &from[i]; msgs[i].msg_hdr.msg_namelen = sizeof from[i];
            msgs[i].msg_hdr.msg_iov = &iov[i]; msgs[i].msg_hdr.msg_iovlen = 1;
        }
        int got = recvmmsg(fd, msgs, BATCH, MSG_DONTWAIT, NULL);
        if (got <= 0) continue;
        count += got;
        if (server) {
            for (int i = 0; i < got; i++) iov[i].iov_len = msgs[i].msg_len;
            sendmmsg(fd, msgs, got, 0);
        }
    }
    printf("%s %lld cpu_s %.6f\n", server ? "echoed" : "roundtrips", count, cpu() - c0);
    return 0;
}
