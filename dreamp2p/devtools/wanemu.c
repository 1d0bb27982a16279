/*
 * wanemu: a packet-level WAN emulator. Forwards IPv4 packets between TUN devices that live in network
 * namespaces, every directed path (port i -> port j) with its own queue, rate, loss, delay and jitter.
 *
 * The model is dreamp2p/devtools/wanmodel.py's, arithmetic and random draws in the same order (SplitMix64,
 * Box-Muller); `--simulate` runs one path over "arrival_s size" lines from stdin and prints "fate departure_s"
 * per packet, so a test can hold the two equal. Built by dreamp2p/devtools/wanemu.py with gcc at first use.
 *
 *   wanemu [model options] --port NETNS,DEV,A.B.C.D [--port ...]   forward (root)
 *   wanemu [model options] --simulate                              one path, trace on stdin
 *   model options: --rate BITS_PER_S --delay S --jitter S --loss F --burst PKTS --queue BYTES
 *                  --reorder 0|1 --seed N
 *   forwarding option: --slack S   sleep until the next departure plus S, sending everything due by then
 *                                  (fewer wakeups, each packet up to S late; default 0)
 *
 * Forwarding: the TUN devices are created here (setns into each namespace, TUNSETIFF; they vanish when this
 * process exits); "ready" on stdout means they exist (the caller then gives them addresses and brings them
 * up). SIGUSR1 prints one JSON line of counters and CPU time; SIGTERM/SIGINT print it and exit 0.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <math.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>

#define MAX_PORTS 64
#define MAX_PKT 65536
#define BATCH 256

enum { DELIVERED = 0, QUEUE_DROP = 1, LOST = 2 };

typedef struct {
    double rate_bps, delay_s, jitter_s, loss, burst;
    long long queue_bytes;
    int reorder;
    uint64_t seed;
} model_t;

typedef struct {
    const model_t *m;
    uint64_t rng;
    double link_free, last_dep, byte_s, limit, p, r;
    int bad;
    unsigned long long in_pkts, in_bytes, queue_drops, lost, out_pkts, out_bytes, write_errors;
} path_t;

typedef struct {
    double dep;
    uint64_t seq;
    int out;
    path_t *path;
    uint32_t len;
    unsigned char data[];
} pkt_t;

static uint64_t splitmix_next(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static double uniform(uint64_t *s) { return (double)(splitmix_next(s) >> 11) * (1.0 / 9007199254740992.0); }

static void path_init(path_t *p, const model_t *m, uint64_t seed) {
    memset(p, 0, sizeof *p);
    p->m = m;
    p->rng = seed;
    p->byte_s = 8.0 / m->rate_bps;
    if (m->queue_bytes > 0) {
        p->limit = (double)m->queue_bytes;
    } else {
        long long q = (long long)(m->rate_bps / 8.0 * 0.1);
        p->limit = (double)(q > (64 << 10) ? q : (64 << 10));
    }
    p->r = 1.0 / m->burst;
    p->p = m->loss * p->r / (1.0 - m->loss);
}

/* wanmodel.PathState.admit */
static int path_admit(path_t *p, double now, uint32_t size, double *dep) {
    const model_t *m = p->m;
    double waiting = p->link_free - now;
    double backlog = waiting > 0.0 ? waiting / p->byte_s : 0.0;
    if (backlog + size > p->limit + 1e-6) return QUEUE_DROP; /* the float sum's rounding */
    double start = p->link_free > now ? p->link_free : now;
    p->link_free = start + size * p->byte_s;
    int lost = 0;
    if (m->loss > 0.0) {
        double u = uniform(&p->rng);
        if (m->burst == 1.0) {
            lost = u < m->loss;
        } else {
            p->bad = p->bad ? u >= p->r : u < p->p;
            lost = p->bad;
        }
    }
    double delay = m->delay_s;
    if (m->jitter_s > 0.0) {
        double u1 = uniform(&p->rng), u2 = uniform(&p->rng);
        delay += m->jitter_s * sqrt(-2.0 * log(1.0 - u1)) * cos(2.0 * M_PI * u2);
        if (delay < 0.0) delay = 0.0;
    }
    if (lost) return LOST;
    double d = p->link_free + delay;
    if (!m->reorder) {
        if (d < p->last_dep) d = p->last_dep;
        p->last_dep = d;
    }
    *dep = d;
    return DELIVERED;
}

/* ------------------------------------------------------------------------------------------ heap */

static pkt_t **heap;
static size_t heap_n, heap_cap;

static int before(const pkt_t *a, const pkt_t *b) { return a->dep < b->dep || (a->dep == b->dep && a->seq < b->seq); }

static void heap_push(pkt_t *x) {
    if (heap_n == heap_cap) {
        heap_cap = heap_cap ? heap_cap * 2 : 4096;
        heap = realloc(heap, heap_cap * sizeof *heap);
        if (!heap) { perror("wanemu: realloc"); exit(1); }
    }
    size_t i = heap_n++;
    while (i > 0) {
        size_t up = (i - 1) / 2;
        if (!before(x, heap[up])) break;
        heap[i] = heap[up];
        i = up;
    }
    heap[i] = x;
}

static pkt_t *heap_pop(void) {
    pkt_t *top = heap[0], *last = heap[--heap_n];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= heap_n) break;
        if (c + 1 < heap_n && before(heap[c + 1], heap[c])) c++;
        if (!before(heap[c], last)) break;
        heap[i] = heap[c];
        i = c;
    }
    if (heap_n) heap[i] = last;
    return top;
}

/* ------------------------------------------------------------------------------------------ main */

static volatile sig_atomic_t stop_flag, dump_flag;
static void on_stop(int sig) { (void)sig; stop_flag = 1; }
static void on_dump(int sig) { (void)sig; dump_flag = 1; }

static double mono(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int nports;
static int fds[MAX_PORTS];
static uint32_t addrs[MAX_PORTS];
static path_t *paths;
static unsigned long long unroutable, wakeups;

static void dump(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    double user = ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6, sys = ru.ru_stime.tv_sec + ru.ru_stime.tv_usec * 1e-6;
    /* sys includes the receiving namespace's stack: a write to a TUN device runs its receive path */
    printf("{\"cpu_s\": %.6f, \"user_s\": %.6f, \"sys_s\": %.6f, \"wakeups\": %llu, \"unroutable\": %llu, "
           "\"queued\": %zu, \"paths\": [",
           user + sys, user, sys, wakeups, unroutable, heap_n);
    int first = 1;
    for (int i = 0; i < nports; i++)
        for (int j = 0; j < nports; j++) {
            if (i == j) continue;
            path_t *p = &paths[i * nports + j];
            printf("%s{\"src\": %d, \"dst\": %d, \"in_pkts\": %llu, \"in_bytes\": %llu, \"queue_drops\": %llu, "
                   "\"lost\": %llu, \"out_pkts\": %llu, \"out_bytes\": %llu, \"write_errors\": %llu}",
                   first ? "" : ", ", i, j, p->in_pkts, p->in_bytes, p->queue_drops, p->lost, p->out_pkts,
                   p->out_bytes, p->write_errors);
            first = 0;
        }
    printf("]}\n");
    fflush(stdout);
}

static int open_tun(const char *ns, const char *dev) {
    char where[512];
    snprintf(where, sizeof where, "/var/run/netns/%s", ns);
    int home = open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
    int nsfd = open(where, O_RDONLY | O_CLOEXEC);
    if (home < 0 || nsfd < 0) { fprintf(stderr, "wanemu: open %s: %s\n", where, strerror(errno)); exit(1); }
    if (setns(nsfd, CLONE_NEWNET) != 0) { fprintf(stderr, "wanemu: setns %s: %s\n", ns, strerror(errno)); exit(1); }
    int fd = open("/dev/net/tun", O_RDWR | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) { fprintf(stderr, "wanemu: open /dev/net/tun: %s\n", strerror(errno)); exit(1); }
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    ifr.ifr_flags = IFF_TUN | IFF_NO_PI;
    snprintf(ifr.ifr_name, IFNAMSIZ, "%s", dev);
    if (ioctl(fd, TUNSETIFF, &ifr) != 0) { fprintf(stderr, "wanemu: TUNSETIFF %s: %s\n", dev, strerror(errno)); exit(1); }
    if (setns(home, CLONE_NEWNET) != 0) { fprintf(stderr, "wanemu: setns back: %s\n", strerror(errno)); exit(1); }
    close(home);
    close(nsfd);
    return fd;
}

static int simulate(const model_t *m) {
    path_t p;
    path_init(&p, m, m->seed);
    double t;
    unsigned size;
    while (scanf("%lf %u", &t, &size) == 2) {
        double dep = 0.0;
        int fate = path_admit(&p, t, size, &dep);
        printf("%d %.9f\n", fate, dep);
    }
    return 0;
}

static void usage(void) {
    fprintf(stderr, "usage: wanemu [--rate BPS --delay S --jitter S --loss F --burst N --queue BYTES --reorder 0|1 "
                    "--seed N] (--simulate | --port NETNS,DEV,IPV4 ...)\n");
    exit(2);
}

int main(int argc, char **argv) {
    model_t m = {.rate_bps = 100e6, .burst = 1.0, .seed = 1};
    int sim = 0;
    double slack = 0.0; /* wake this late for a due packet, so the ones due meanwhile go in the same wakeup */
    char *ports[MAX_PORTS];
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--simulate")) { sim = 1; continue; }
        if (i + 1 >= argc) usage();
        const char *v = argv[++i];
        if (!strcmp(a, "--rate")) m.rate_bps = atof(v);
        else if (!strcmp(a, "--delay")) m.delay_s = atof(v);
        else if (!strcmp(a, "--jitter")) m.jitter_s = atof(v);
        else if (!strcmp(a, "--loss")) m.loss = atof(v);
        else if (!strcmp(a, "--burst")) m.burst = atof(v);
        else if (!strcmp(a, "--queue")) m.queue_bytes = atoll(v);
        else if (!strcmp(a, "--reorder")) m.reorder = atoi(v);
        else if (!strcmp(a, "--seed")) m.seed = strtoull(v, NULL, 10);
        else if (!strcmp(a, "--slack")) slack = atof(v);
        else if (!strcmp(a, "--port")) {
            if (nports == MAX_PORTS) usage();
            ports[nports++] = strdup(v);
        } else usage();
    }
    if (!(m.rate_bps > 0) || m.burst < 1.0 || m.loss < 0 || m.loss >= 1) usage();
    if (sim) return simulate(&m);
    if (nports < 2) usage();

    for (int i = 0; i < nports; i++) {
        char *ns = ports[i], *dev = strchr(ns, ','), *ip;
        if (!dev || !(ip = strchr(dev + 1, ','))) usage();
        *dev++ = 0;
        *ip++ = 0;
        struct in_addr in;
        if (inet_pton(AF_INET, ip, &in) != 1) usage();
        addrs[i] = in.s_addr;
        fds[i] = open_tun(ns, dev);
    }
    paths = calloc((size_t)nports * nports, sizeof *paths);
    for (int i = 0; i < nports; i++)
        for (int j = 0; j < nports; j++) path_init(&paths[i * nports + j], &m, m.seed + 256ULL * i + j);

    prctl(PR_SET_TIMERSLACK, 1UL);
    prctl(PR_SET_PDEATHSIG, SIGTERM); /* never outlive the process that made the namespaces */
    if (getppid() == 1) return 1;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sa.sa_handler = on_dump;
    sigaction(SIGUSR1, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    printf("ready\n");
    fflush(stdout);

    struct pollfd pfd[MAX_PORTS];
    for (int i = 0; i < nports; i++) pfd[i] = (struct pollfd){.fd = fds[i], .events = POLLIN};
    unsigned char *buf = malloc(MAX_PKT);
    uint64_t seq = 0;
    double t0 = mono();
    while (!stop_flag) {
        double now = mono() - t0;
        while (heap_n && heap[0]->dep <= now) {
            pkt_t *x = heap_pop();
            if (write(fds[x->out], x->data, x->len) == (ssize_t)x->len) {
                x->path->out_pkts++;
                x->path->out_bytes += x->len;
            } else {
                x->path->write_errors++;
            }
            free(x);
        }
        if (dump_flag) { dump_flag = 0; dump(); }
        struct timespec ts = {1, 0};
        if (heap_n) {
            double wait = heap[0]->dep + slack - (mono() - t0);
            if (wait < 0) wait = 0;
            ts.tv_sec = (time_t)wait;
            ts.tv_nsec = (long)((wait - (double)ts.tv_sec) * 1e9);
        }
        int n = ppoll(pfd, (nfds_t)nports, &ts, NULL);
        wakeups++;
        if (n <= 0) continue;
        for (int i = 0; i < nports; i++) {
            if (!(pfd[i].revents & POLLIN)) continue;
            for (int k = 0; k < BATCH; k++) {
                ssize_t len = read(fds[i], buf, MAX_PKT);
                if (len <= 0) break;
                double at = mono() - t0;
                int j = -1;
                if (len >= 20 && (buf[0] >> 4) == 4) {
                    uint32_t dst;
                    memcpy(&dst, buf + 16, 4);
                    for (int c = 0; c < nports; c++)
                        if (addrs[c] == dst) { j = c; break; }
                }
                if (j < 0 || j == i) { unroutable++; continue; }
                path_t *p = &paths[i * nports + j];
                p->in_pkts++;
                p->in_bytes += (unsigned long long)len;
                double dep;
                int fate = path_admit(p, at, (uint32_t)len, &dep);
                if (fate == QUEUE_DROP) { p->queue_drops++; continue; }
                if (fate == LOST) { p->lost++; continue; }
                pkt_t *x = malloc(sizeof *x + (size_t)len);
                if (!x) { perror("wanemu: malloc"); exit(1); }
                x->dep = dep;
                x->seq = seq++;
                x->out = j;
                x->path = p;
                x->len = (uint32_t)len;
                memcpy(x->data, buf, (size_t)len);
                heap_push(x);
            }
        }
    }
    dump();
    return 0;
}
