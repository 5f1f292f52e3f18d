/*
 * LD_PRELOAD shim for tests: the wall clock (CLOCK_REALTIME and its readers) runs
 * PROXYSHIFT_REALTIME_OFFSET seconds ahead (or behind, when negative); every other
 * clock is untouched.
 *
 * Why not libfaketime: 0.9.10 with Python 3.11 either hangs every timed lock wait
 * (sem_clockwait gets a wall-clock deadline on the monotonic clock) or, with
 * FAKETIME_DONT_FAKE_MONOTONIC=1, fails ~13% of time.sleep() calls with EINVAL.
 * Python waits and sleeps on CLOCK_MONOTONIC only, so offsetting the wall clock
 * alone is a skew the process cannot tell from a real one.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>

static long offset_seconds(void) {
    static int read;
    static long offset;
    if (!read) {
        const char *text = getenv("PROXYSHIFT_REALTIME_OFFSET");
        offset = text ? strtol(text, NULL, 10) : 0;
        read = 1;
    }
    return offset;
}

int clock_gettime(clockid_t clock, struct timespec *ts) {
    static int (*real)(clockid_t, struct timespec *);
    if (!real)
        real = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
    int rc = real(clock, ts);
    if (rc == 0 && (clock == CLOCK_REALTIME || clock == CLOCK_REALTIME_COARSE))
        ts->tv_sec += offset_seconds();
    return rc;
}

int gettimeofday(struct timeval *restrict tv, void *restrict tz) {
    static int (*real)(struct timeval *restrict, void *restrict);
    if (!real)
        real = (int (*)(struct timeval *restrict, void *restrict))dlsym(RTLD_NEXT, "gettimeofday");
    int rc = real(tv, tz);
    if (rc == 0)
        tv->tv_sec += offset_seconds();
    return rc;
}

time_t time(time_t *out) {
    struct timespec ts;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0)
        return (time_t)-1;
    if (out)
        *out = ts.tv_sec;
    return ts.tv_sec;
}
