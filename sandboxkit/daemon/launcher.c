/* sandboxkit's per-sandbox launcher: started once inside a sandbox (its cgroups, its
 * rlimits, its namespaces), it forks and execs the commands the daemon sends it, so a
 * command pays neither the wrapper's exec, nor the cgroup migration, nor bubblewrap's
 * set-up (sandboxkit/daemon/launcher.py says why and how it is used).
 *
 * argv[1] is the descriptor of a SOCK_SEQPACKET socket to the daemon; every other
 * inherited descriptor is closed at start. One message a datagram, all little integers
 * in the host's byte order (the daemon is on the same machine):
 *
 *   daemon -> launcher
 *     'L' id argc envc, then "cwd\0argv0\0...\0env0\0...\0", with three descriptors
 *     (SCM_RIGHTS): the command's stdin, stdout and stderr.
 *     'A' id 0 0, once the daemon has the pid out of an 'S': until then the command is
 *     not reaped, so that its pidfd names a process (the daemon reads its pid there).
 *   launcher -> daemon
 *     'H' version 0 0          once, at start
 *     'S' id pid 0             started; with its pidfd (SCM_RIGHTS)
 *     'F' id errno 0           not started (fork failed, a bad request); a command that
 *                              cannot be executed exits 127 (or 126) saying so instead
 *     'X' id wait-status 0     a command it started ended (its wait status)
 *
 * A header is four 32-bit words: the type in the first. The launcher trusts the daemon
 * (its socket's other end is the daemon's alone); the daemon trusts nothing the launcher
 * says beyond its own sandbox (sandboxkit/daemon/launcher.py checks every reply).
 *
 * It ends when the daemon closes the socket; the commands it started go on (the sandbox
 * ends them). Built by hatch_build.py at install; without a C compiler there is no
 * launcher, and a sandbox keeps a shell started ahead instead (sandboxkit/daemon/standby.py). */

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#define VERSION 1
#define MAX_REQUEST (256 * 1024) /* what the daemon sends at most (launcher.py) */

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_close_range
#define SYS_close_range 436
#endif

static int sock = -1;

struct started {
    pid_t pid;
    uint32_t id;
    int acked;
};
static struct started *running;
static size_t n_running, cap_running;

static void say(uint32_t type, uint32_t a, uint32_t b, int fd) {
    uint32_t head[4] = {type, a, b, 0};
    struct iovec iov = {head, sizeof head};
    union {
        struct cmsghdr align;
        char buf[CMSG_SPACE(sizeof(int))];
    } control;
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
    if (fd >= 0) {
        memset(&control, 0, sizeof control);
        msg.msg_control = control.buf;
        msg.msg_controllen = sizeof control.buf;
        struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg);
        cmsg->cmsg_level = SOL_SOCKET;
        cmsg->cmsg_type = SCM_RIGHTS;
        cmsg->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cmsg), &fd, sizeof(int));
    }
    while (sendmsg(sock, &msg, MSG_NOSIGNAL) < 0) {
        if (errno != EINTR)
            _exit(0); /* the daemon is gone */
    }
}

/* execve argv[0] as a shell would: along the PATH of the command's own environment. */
static int exec_along_path(char **argv, char **envp) {
    if (strchr(argv[0], '/')) {
        execve(argv[0], argv, envp);
        return errno;
    }
    const char *path = "/usr/local/bin:/usr/bin:/bin";
    for (char **e = envp; *e; e++)
        if (strncmp(*e, "PATH=", 5) == 0)
            path = *e + 5;
    int found = ENOENT;
    size_t name_len = strlen(argv[0]);
    char buf[4096];
    while (1) {
        const char *end = strchrnul(path, ':');
        size_t dir_len = (size_t)(end - path);
        if (dir_len + name_len + 2 <= sizeof buf) {
            memcpy(buf, path, dir_len);
            size_t at = dir_len;
            if (dir_len == 0)
                buf[at++] = '.';
            buf[at++] = '/';
            memcpy(buf + at, argv[0], name_len + 1);
            execve(buf, argv, envp);
            if (errno != ENOENT && errno != ENOTDIR)
                found = errno; /* EACCES and the like: reported unless found later */
        }
        if (*end == '\0')
            return found;
        path = end + 1;
    }
}

/* Put s on fd 2, as far as it goes (a message for the command's stderr). */
static void tell(const char *s) {
    size_t len = strlen(s);
    while (len) {
        ssize_t n = write(2, s, len);
        if (n <= 0)
            return;
        s += n;
        len -= (size_t)n;
    }
}

/* In the forked child: become the command, or say why not on its stderr and exit as a
 * shell would (127: not found, 126: found but not executable, or no such cwd). */
__attribute__((noreturn)) static void child(const int fds[3], const char *cwd, char **argv,
                                            char **envp) {
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    setsid();
    int high[3];
    for (int i = 0; i < 3; i++) /* above 2 first, so no dup2 overwrites another's source */
        if ((high[i] = fcntl(fds[i], F_DUPFD_CLOEXEC, 3)) < 0)
            _exit(126);
    for (int i = 0; i < 3; i++)
        if (dup2(high[i], i) < 0)
            _exit(126);
    if (chdir(cwd) < 0) {
        int err = errno;
        tell("sandboxkit: cannot enter ");
        tell(cwd);
        tell(": ");
        tell(strerror(err));
        tell("\n");
        _exit(126);
    }
    int err = exec_along_path(argv, envp);
    tell("sandboxkit: cannot execute ");
    tell(argv[0]);
    tell(": ");
    tell(strerror(err));
    tell("\n");
    _exit(err == ENOENT ? 127 : 126);
}

static void track(pid_t pid, uint32_t id) {
    if (n_running == cap_running) {
        size_t cap = cap_running ? cap_running * 2 : 16;
        struct started *grown = realloc(running, cap * sizeof *grown);
        if (!grown)
            abort();
        running = grown;
        cap_running = cap;
    }
    running[n_running++] = (struct started){pid, id, 0};
}

static void launch(char *buf, size_t len, const int fds[3]) {
    uint32_t head[4];
    memcpy(head, buf, sizeof head);
    uint32_t id = head[1], argc = head[2], envc = head[3];
    /* The strings: cwd, argc arguments, envc variables, each ending in NUL. */
    size_t want = 1 + (size_t)argc + envc, seen = 0;
    if (argc == 0 || argc > MAX_REQUEST || envc > MAX_REQUEST || len == sizeof head ||
        buf[len - 1] != '\0') {
        say('F', id, EINVAL, -1);
        return;
    }
    for (size_t i = sizeof head; i < len; i++)
        seen += buf[i] == '\0';
    if (seen != want) {
        say('F', id, EINVAL, -1);
        return;
    }
    char **strings = calloc(want + 2, sizeof *strings); /* argv's NULL, envp's NULL */
    if (!strings) {
        say('F', id, ENOMEM, -1);
        return;
    }
    char *at = buf + sizeof head;
    for (size_t i = 0, slot = 0; i < want; i++) {
        strings[slot++] = at;
        at += strlen(at) + 1;
        if (i == argc)
            slot++; /* argv's NULL, between argv and envp */
    }
    const char *cwd = strings[0];
    char **argv = strings + 1, **envp = strings + 1 + argc + 1;
    /* A fork, answered at once: the command's exec (and, on 2 cores, its first
     * instructions, which a vfork's parent waited behind) runs meanwhile. What cannot be
     * executed exits 127 (or 126) saying so, as through a shell. */
    pid_t pid = fork();
    if (pid == 0)
        child(fds, cwd, argv, envp);
    free(strings);
    if (pid < 0) {
        say('F', id, (uint32_t)errno, -1);
        return;
    }
    int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
    if (pidfd < 0) { /* the daemon needs it: no command it cannot see */
        int err = errno;
        kill(pid, SIGKILL);
        while (waitpid(pid, NULL, 0) < 0 && errno == EINTR)
            ;
        say('F', id, (uint32_t)err, -1);
        return;
    }
    track(pid, id);
    say('S', id, (uint32_t)pid, pidfd);
    close(pidfd);
}

/* Reap the commands that ended, of those the daemon acknowledged. Its only children are
 * the commands (it is neither PID 1 nor a subreaper: orphans go elsewhere). */
static void reap(void) {
    for (size_t i = 0; i < n_running;) {
        int status;
        if (running[i].acked && waitpid(running[i].pid, &status, WNOHANG) > 0) {
            say('X', running[i].id, (uint32_t)status, -1);
            running[i] = running[--n_running];
        } else {
            i++;
        }
    }
}

static void ack(uint32_t id) {
    for (size_t i = 0; i < n_running; i++)
        if (running[i].id == id)
            running[i].acked = 1;
    reap(); /* it may have ended already, its SIGCHLD read before */
}

static void serve(void) {
    static char buf[MAX_REQUEST + 16];
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    sigprocmask(SIG_BLOCK, &chld, NULL);
    int sigfd = signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK);
    if (sigfd < 0)
        _exit(1);
    say('H', VERSION, 0, -1);
    struct pollfd watch[2] = {{sock, POLLIN, 0}, {sigfd, POLLIN, 0}};
    while (1) {
        if (poll(watch, 2, -1) < 0) {
            if (errno == EINTR)
                continue;
            _exit(1);
        }
        if (watch[1].revents) {
            struct signalfd_siginfo info;
            while (read(sigfd, &info, sizeof info) > 0)
                ;
            reap();
        }
        if (!watch[0].revents)
            continue;
        union {
            struct cmsghdr align;
            char buf[CMSG_SPACE(3 * sizeof(int))];
        } control;
        struct iovec iov = {buf, sizeof buf};
        struct msghdr msg = {.msg_iov = &iov,
                             .msg_iovlen = 1,
                             .msg_control = control.buf,
                             .msg_controllen = sizeof control.buf};
        ssize_t got = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            _exit(0); /* the daemon closed it: done */
        int fds[3] = {-1, -1, -1}, n_fds = 0;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
            if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
                size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
                for (size_t i = 0; i < n; i++) {
                    int fd;
                    memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
                    if (n_fds < 3)
                        fds[n_fds++] = fd;
                    else
                        close(fd);
                }
            }
        }
        uint32_t type = 0, id = 0;
        if ((size_t)got >= 4 * sizeof(uint32_t)) {
            memcpy(&type, buf, sizeof type);
            memcpy(&id, buf + sizeof type, sizeof id);
        }
        if (type == 'A' && n_fds == 0)
            ack(id);
        else if (type != 'L' || n_fds != 3 || (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)))
            say('F', id, EINVAL, -1);
        else
            launch(buf, (size_t)got, fds);
        for (int i = 0; i < n_fds; i++)
            close(fds[i]);
    }
}

int main(int argc, char **argv) {
    if (argc != 2)
        return 2;
    char *end;
    long fd = strtol(argv[1], &end, 10);
    if (*end != '\0' || fd < 3 || fd > 65535)
        return 2;
    sock = (int)fd;
    if (fcntl(sock, F_SETFD, FD_CLOEXEC) < 0)
        return 2;
    /* Nothing else inherited stays open: the program's own descriptor, bubblewrap's. */
    if (sock > 3 && syscall(SYS_close_range, 3, sock - 1, 0) < 0)
        for (int i = 3; i < sock; i++)
            close(i);
    if (syscall(SYS_close_range, sock + 1, ~0U, 0) < 0)
        for (int i = sock + 1; i < 1024; i++)
            close(i);
    serve();
    return 0;
}
