/* Threads of the daemon's own that take no signals: SIGTERM, SIGINT and SIGHUP go to the main
 * (socket) thread, whose loop reads the flags their handler sets. A worker that took one could
 * see a blocking call fail with EINTR part way (a reply's frames half sent). */
#ifndef SKV_THREAD_H
#define SKV_THREAD_H

#include <pthread.h>
#include <signal.h>

/* pthread_create, named `name`, with the daemon's signals blocked in the new thread (from its first
 * instruction: the mask is set around the creation, not by the thread itself). Faults (SIGSEGV,
 * SIGBUS: the sanitizers report through them) stay unblocked. */
static inline int skv_thread_create(pthread_t *t, void *(*fn)(void *), void *arg, const char *name)
{
    sigset_t all, old;
    sigemptyset(&all);
    sigaddset(&all, SIGTERM);
    sigaddset(&all, SIGINT);
    sigaddset(&all, SIGHUP);
    sigaddset(&all, SIGALRM);
    sigaddset(&all, SIGCHLD);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int rc = pthread_create(t, NULL, fn, arg);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc == 0)
        pthread_setname_np(*t, name); /* top -H, /proc/PID/task/TID/comm; at most 15 characters */
    return rc;
}

#endif
