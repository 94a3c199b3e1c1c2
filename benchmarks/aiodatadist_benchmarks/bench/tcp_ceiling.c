/* The TCP ceiling of `bench`: NBYTES moved from one process to another over CONNECTIONS loopback TCP
 * connections, as iperf moves them: one sender thread and one receiver thread per connection, each sending
 * (receiving) its share with large send()/recv() calls from (into) a buffer allocated and touched beforehand.
 *
 *   tcp_ceiling NBYTES CONNECTIONS ROUNDS [CONGESTION]
 *
 * The receiving process (this one) forks the sender after it listens.  A round sends one byte on every
 * connection and times until every share has arrived.  A first round warms the connections up (not printed);
 * then ROUNDS rounds print one line each, their seconds.  With ROUNDS 0 the program prints "ready" after the
 * warm-up and runs a round for each line read on stdin, until stdin closes: an instrument to read in turn with a
 * workload.  Every connection has TCP_NODELAY, and CONGESTION (a congestion control name, "-" for the
 * system's) on both ends, as the data plane sets them.  Exits non-zero with a message on stderr when anything
 * fails, or when the bytes that arrived are not the ones sent.  Built by tcp_ceiling.py with the system's C
 * compiler: cc -O2 -pthread.
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
    pthread_barrier_t *start, *done;
    const int *stop;
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

/* 0: all n bytes arrived; 1: the peer closed before the first byte; -1: an error or a short read */
static int recv_all(int fd, unsigned char *buf, size_t n) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = recv(fd, buf + got, n - got < CHUNK ? n - got : CHUNK, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r == 0 && got == 0) return 1;
        if (r <= 0) return -1;
        got += (size_t)r;
    }
    return 0;
}

static unsigned char *touched(size_t n, int value) {
    unsigned char *buf = malloc(n ? n : 1);
    if (buf == NULL) die("malloc");
    memset(buf, value, n);
    return buf;
}

static size_t share_of(size_t nbytes, int n, int i) {
    return nbytes / (size_t)n + (i == n - 1 ? nbytes % (size_t)n : 0);
}

/* -- the sending process: a round per byte received, until the receiver closes ------------------------------ */
static void *sender(void *arg) {
    struct stream *s = arg;
    unsigned char go;
    int got;
    while ((got = recv_all(s->fd, &go, 1)) == 0)
        if (send_all(s->fd, s->buf, s->share)) break;
    s->failed = got != 1;
    return NULL;
}

static void send_side(uint16_t port, size_t nbytes, int n, const char *congestion) {
    struct sockaddr_in to = {.sin_family = AF_INET, .sin_port = port, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    struct stream streams[MAX_CONNECTIONS];
    pthread_t threads[MAX_CONNECTIONS];
    for (int i = 0; i < n; i++) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd < 0) die("socket");
        tune(fd, congestion);
        if (connect(fd, (struct sockaddr *)&to, sizeof to)) die("connect");
        streams[i] = (struct stream){.fd = fd, .buf = touched(share_of(nbytes, n, i), PATTERN),
                                     .share = share_of(nbytes, n, i)};
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

/* -- the receiving process: the rounds, timed --------------------------------------------------------------- */
static void *receiver(void *arg) {
    struct stream *s = arg;
    for (;;) {
        pthread_barrier_wait(s->start);
        if (*s->stop) return NULL;
        if (!s->failed && recv_all(s->fd, s->buf, s->share)) s->failed = 1;
        pthread_barrier_wait(s->done);
    }
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

struct receivers {
    int n;
    pid_t sender;
    struct stream streams[MAX_CONNECTIONS];
    pthread_t threads[MAX_CONNECTIONS];
    pthread_barrier_t start, done;
    int stop;
};

/* One round: its seconds; on a failure both processes end here (the receivers may be stuck in a recv). */
static double round_trip(struct receivers *r) {
    static const unsigned char go = 'g';
    double began = now();
    for (int i = 0; i < r->n; i++)
        if (!r->streams[i].failed && send_all(r->streams[i].fd, &go, 1)) r->streams[i].failed = 1;
    pthread_barrier_wait(&r->start);
    pthread_barrier_wait(&r->done);
    double took = now() - began;
    for (int i = 0; i < r->n; i++) {
        struct stream *s = &r->streams[i];
        int wrong = !s->failed && (s->buf[0] != PATTERN || s->buf[s->share / 2] != PATTERN
                                   || s->buf[s->share - 1] != PATTERN);
        if (s->failed || wrong) {
            kill(r->sender, SIGKILL);
            waitpid(r->sender, NULL, 0);
            fprintf(stderr, "tcp_ceiling: %s\n", wrong ? "wrong bytes arrived" : "a connection failed");
            exit(1);
        }
        s->buf[0] = s->buf[s->share / 2] = s->buf[s->share - 1] = 0; /* the next round brings them again */
    }
    return took;
}

static void receive_side(struct receivers *r, int listener, const char *congestion) {
    pthread_barrier_init(&r->start, NULL, (unsigned)r->n + 1);
    pthread_barrier_init(&r->done, NULL, (unsigned)r->n + 1);
    for (int i = 0; i < r->n; i++) {
        int fd = accept(listener, NULL, NULL);
        if (fd < 0) {
            int failure = errno;
            kill(r->sender, SIGKILL);
            errno = failure;
            die("accept");
        }
        tune(fd, congestion);
        r->streams[i].fd = fd;
    }
    close(listener);
    for (int i = 0; i < r->n; i++)
        if (pthread_create(&r->threads[i], NULL, receiver, &r->streams[i])) die("pthread_create");
}

static int finish(struct receivers *r) {
    r->stop = 1;
    pthread_barrier_wait(&r->start);
    for (int i = 0; i < r->n; i++) {
        pthread_join(r->threads[i], NULL);
        close(r->streams[i].fd);
    }
    int status = 0;
    if (waitpid(r->sender, &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "tcp_ceiling: the sender failed\n");
        return 1;
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 4 || argc > 5) {
        fprintf(stderr, "usage: tcp_ceiling NBYTES CONNECTIONS ROUNDS [CONGESTION]\n");
        return 2;
    }
    size_t nbytes = strtoull(argv[1], NULL, 10);
    int n = atoi(argv[2]), rounds = atoi(argv[3]);
    const char *congestion = argc == 5 && strcmp(argv[4], "-") != 0 ? argv[4] : NULL;
    if (n < 1 || n > MAX_CONNECTIONS || rounds < 0 || nbytes < (size_t)n) {
        fprintf(stderr, "tcp_ceiling: need 1 <= CONNECTIONS <= %d, ROUNDS >= 0, NBYTES >= CONNECTIONS\n",
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
    static struct receivers r;
    r.n = n;
    for (int i = 0; i < n; i++)
        r.streams[i] = (struct stream){.buf = touched(share_of(nbytes, n, i), 0), .share = share_of(nbytes, n, i),
                                       .start = &r.start, .done = &r.done, .stop = &r.stop};
    r.sender = fork();
    if (r.sender < 0) die("fork");
    if (r.sender == 0) {
        close(listener);
        send_side(at.sin_port, nbytes, n, congestion);
    }
    receive_side(&r, listener, congestion);
    round_trip(&r); /* the warm-up */
    if (rounds > 0) {
        for (int round = 0; round < rounds; round++) printf("%.9f\n", round_trip(&r));
    } else {
        printf("ready\n");
        fflush(stdout);
        char line[64];
        while (fgets(line, sizeof line, stdin) != NULL) {
            printf("%.9f\n", round_trip(&r));
            fflush(stdout);
        }
    }
    fflush(stdout);
    return finish(&r);
}
