/* A native backtrace of every thread of a process that cannot be ptraced (qemu-user has no ptrace): preloaded
 * (LD_PRELOAD), it makes SIGUSR2 print the receiving thread's name and stack to the file named by BTDUMP_FILE
 * (stderr without it). Send the signal to each thread with tgkill (benchmarks/arm64/fork_hang.py does).
 * It also reports a SIGILL (an instruction this core lacks): the faulting address, the library and offset it lies
 * in, and the stack, then lets the process die as it would have.
 * Build: cc -shared -fPIC -O1 -o btdump.so btdump.c -ldl */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

static char path[512];

static void dump(int sig) {
    (void)sig;
    void *frames[64];
    char name[17] = {0};
    char head[160];
    int n = backtrace(frames, 64);
    prctl(PR_GET_NAME, name, 0, 0, 0);
    int fd = path[0] ? open(path, O_WRONLY | O_APPEND | O_CREAT, 0644) : 2;
    if (fd < 0) return;
    int len = snprintf(head, sizeof head, "--- pid %d tid %ld (%s): %d frames\n", getpid(),
                       (long)syscall(SYS_gettid), name, n);
    if (write(fd, head, (size_t)len) < 0) { /* nothing to do */ }
    backtrace_symbols_fd(frames, n, fd);
    if (fd != 2) close(fd);
}

static void illegal(int sig, siginfo_t *info, void *context) {
    (void)context;
    Dl_info where;
    char head[700];
    int fd = path[0] ? open(path, O_WRONLY | O_APPEND | O_CREAT, 0644) : 2;
    if (fd < 0) fd = 2;
    memset(&where, 0, sizeof where);
    dladdr(info->si_addr, &where);
    unsigned int word = info->si_addr ? *(unsigned int *)info->si_addr : 0;
    int len = snprintf(head, sizeof head, "--- SIGILL pid %d tid %ld at %p: instruction word 0x%08x in %s (base %p, "
                       "offset 0x%lx), nearest symbol %s\n", getpid(), (long)syscall(SYS_gettid), info->si_addr, word,
                       where.dli_fname ? where.dli_fname : "?", where.dli_fbase,
                       (unsigned long)((char *)info->si_addr - (char *)where.dli_fbase),
                       where.dli_sname ? where.dli_sname : "?");
    if (write(fd, head, (size_t)len) < 0) { /* nothing to do */ }
    void *frames[64];
    int n = backtrace(frames, 64);
    backtrace_symbols_fd(frames, n, fd);
    if (fd != 2) close(fd);
    signal(sig, SIG_DFL);
}

__attribute__((constructor)) static void install(void) {
    void *warm[2];
    const char *target = getenv("BTDUMP_FILE");
    if (target) snprintf(path, sizeof path, "%s", target);
    backtrace(warm, 2); /* loads the unwinder now, not inside the handler */
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_handler = dump;
    action.sa_flags = SA_RESTART;
    sigaction(SIGUSR2, &action, NULL);
    struct sigaction fault;
    memset(&fault, 0, sizeof fault);
    fault.sa_sigaction = illegal;
    fault.sa_flags = SA_SIGINFO;
    sigaction(SIGILL, &fault, NULL);
}
