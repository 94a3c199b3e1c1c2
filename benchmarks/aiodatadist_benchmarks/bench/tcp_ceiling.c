/* The TCP ceiling of `bench`: NBYTES moved from one process to another over CONNECTIONS loopback TCP
 * connections, as iperf moves them: one sender thread and one receiver thread per connection, each sending
 * (receiving) its share with large send()/recv() calls from (into) a buffer allocated and touched beforehand.
 *
 *   tcp_ceiling NBYTES CONNECTIONS ROUNDS [CONGESTION]
 *
 * The receiving process (this one) forks the sender after it listens.  Each round it sends one byte on every
 * connection and times until every share has arrived; the first round warms the connections up and is not
 * printed, then one line per round gives its seconds.  Every connection has TCP_NODELAY, and CONGESTION (a
 * congestion control name, "-" for the system's) on both ends, as the data plane sets them.  Exits non-zero
 * with a message on stderr when anything fails, or when the bytes that arrived are not the ones sent.
 * Built by tcp_ceiling.py with the system's C compiler: cc -O2 -pthread.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_CONNECTIONS 64
#define PATTERN 0x5a
#define CHUNK (1u << 30) /* bytes per send()/recv() call at most */
#define ACCEPT_TIMEOUT_S 60

struct stream {
    int fd;
    unsigned char *buf;
    size_t share;
    int rounds;
    pthread_barrier_t *start, *done;
    int failed;
};

static void die(const char *what) {
    fprintf(stderr, "tcp_ceiling: %s: %s\n", what, strerror(errno));
    exit(1);
}

static void tune(int fd, const char *congestion) {
    int one = 1;
    if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one)) die("TCP_NODELAY");
    if (congestion != NULL && setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, congestion, strlen(congestion)))
        die("TCP_CONGESTION");
}

static int send_all(int fd, const unsigned char *buf, size_t n) {
    while (n > 0) {
        ssize_t sent = send(fd, buf, n < CHUNK ? n : CHUNK, MSG_NOSIGNAL);
        if (sent < 0 && errno == EINTR) continue;
        if (sent <= 0) return -1;
        buf += sent;
        n -= (size_t)sent;
    }
    return 0;
}

static int recv_all(int fd, unsigned char *buf, size_t n) {
    while (n > 0) {
        ssize_t got = recv(fd, buf, n < CHUNK ? n : CHUNK, 0);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) return -1;
        buf += got;
        n -= (size_t)got;
    }
    return 0;
}

static unsigned char *touched(size_t n, int value) {
    unsigned char *buf = malloc(n ? n : 1);
    if (buf == NULL) die("malloc");
    memset(buf, value, n);
    return buf;
}

static void *sender(void *arg) {
    struct stream *s = arg;
    unsigned char go;
    for (int round = 0; round < s->rounds; round++) {
        if (recv_all(s->fd, &go, 1) || send_all(s->fd, s->buf, s->share)) {
            s->failed = 1;
            break;
        }
    }
    return NULL;
}

static void *receiver(void *arg) {
    struct stream *s = arg;
    for (int round = 0; round < s->rounds; round++) {
        pthread_barrier_wait(s->start);
        if (!s->failed && recv_all(s->fd, s->buf, s->share)) s->failed = 1;
        pthread_barrier_wait(s->done);
    }
    return NULL;
}

static size_t share_of(size_t nbytes, int n, int i) {
    return nbytes / (size_t)n + (i == n - 1 ? nbytes % (size_t)n : 0);
}

static void send_side(uint16_t port, size_t nbytes, int n, int rounds, const char *congestion) {
    struct sockaddr_in to = {.sin_family = AF_INET, .sin_port = port, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    struct stream streams[MAX_CONNECTIONS];
    pthread_t threads[MAX_CONNECTIONS];
    for (int i = 0; i < n; i++) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd < 0) die("socket");
        tune(fd, congestion);
        if (connect(fd, (struct sockaddr *)&to, sizeof to)) die("connect");
        streams[i] = (struct stream){.fd = fd, .buf = touched(share_of(nbytes, n, i), PATTERN),
                                     .share = share_of(nbytes, n, i), .rounds = rounds};
    }
    for (int i = 0; i < n; i++)
        if (pthread_create(&threads[i], NULL, sender, &streams[i])) die("pthread_create");
    int failed = 0;
    for (int i = 0; i < n; i++) {
        pthread_join(threads[i], NULL);
        failed |= streams[i].failed;
        close(streams[i].fd);
    }
    _exit(failed ? 1 : 0);
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc < 4 || argc > 5) {
        fprintf(stderr, "usage: tcp_ceiling NBYTES CONNECTIONS ROUNDS [CONGESTION]\n");
        return 2;
    }
    size_t nbytes = strtoull(argv[1], NULL, 10);
    int n = atoi(argv[2]), rounds = atoi(argv[3]) + 1; /* + the warm-up round */
    const char *congestion = argc == 5 && strcmp(argv[4], "-") != 0 ? argv[4] : NULL;
    if (n < 1 || n > MAX_CONNECTIONS || rounds < 2 || nbytes < (size_t)n) {
        fprintf(stderr, "tcp_ceiling: need 1 <= CONNECTIONS <= %d, ROUNDS >= 1, NBYTES >= CONNECTIONS\n",
                MAX_CONNECTIONS);
        return 2;
    }
    int listener = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in at = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t size = sizeof at;
    if (listener < 0 || bind(listener, (struct sockaddr *)&at, sizeof at) || listen(listener, n)
        || getsockname(listener, (struct sockaddr *)&at, &size))
        die("listen");
    tune(listener, congestion); /* an unknown or refused algorithm fails here, before the sender starts */
    struct timeval patience = {.tv_sec = ACCEPT_TIMEOUT_S}; /* a sender that died is not waited for */
    if (setsockopt(listener, SOL_SOCKET, SO_RCVTIMEO, &patience, sizeof patience)) die("SO_RCVTIMEO");
    fflush(stdout);
    pid_t child = fork();
    if (child < 0) die("fork");
    if (child == 0) {
        close(listener);
        send_side(at.sin_port, nbytes, n, rounds, congestion);
    }
    pthread_barrier_t start, done;
    pthread_barrier_init(&start, NULL, (unsigned)n + 1);
    pthread_barrier_init(&done, NULL, (unsigned)n + 1);
    struct stream streams[MAX_CONNECTIONS];
    pthread_t threads[MAX_CONNECTIONS];
    for (int i = 0; i < n; i++) {
        int fd = accept(listener, NULL, NULL);
        if (fd < 0) {
            int failure = errno;
            kill(child, SIGKILL);
            errno = failure;
            die("accept");
        }
        tune(fd, congestion);
        streams[i] = (struct stream){.fd = fd, .buf = touched(share_of(nbytes, n, i), 0),
                                     .share = share_of(nbytes, n, i), .rounds = rounds, .start = &start,
                                     .done = &done};
    }
    close(listener);
    for (int i = 0; i < n; i++)
        if (pthread_create(&threads[i], NULL, receiver, &streams[i])) die("pthread_create");
    const unsigned char go = 'g';
    int failed = 0;
    for (int round = 0; round < rounds; round++) {
        double began = now();
        for (int i = 0; i < n; i++)
            if (!streams[i].failed && send_all(streams[i].fd, &go, 1)) streams[i].failed = 1;
        pthread_barrier_wait(&start);
        pthread_barrier_wait(&done);
        double took = now() - began;
        for (int i = 0; i < n; i++) failed |= streams[i].failed;
        if (failed) { /* the receivers may be stuck in a recv: end both processes here */
            kill(child, SIGKILL);
            waitpid(child, NULL, 0);
            fprintf(stderr, "tcp_ceiling: a connection failed\n");
            return 1;
        }
        if (round > 0) printf("%.9f\n", took);
    }
    for (int i = 0; i < n; i++) {
        pthread_join(threads[i], NULL);
        struct stream *s = &streams[i];
        if (!failed && (s->buf[0] != PATTERN || s->buf[s->share / 2] != PATTERN || s->buf[s->share - 1] != PATTERN))
            failed = 2;
        close(s->fd);
    }
    int status = 0;
    if (waitpid(child, &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) failed |= 1;
    if (failed) fprintf(stderr, "tcp_ceiling: %s\n", failed == 2 ? "wrong bytes arrived" : "a connection failed");
    return failed ? 1 : 0;
}
