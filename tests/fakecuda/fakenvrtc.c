/*
 * fakenvrtc.c: a recording stand-in for NVRTC (libnvrtc.so), built by the
 * l2prefetch test suite (tests/_fakecuda.py) so that every NVRTC call site of
 * the extension can be made to fail on machines with or without a real NVRTC.
 *
 * What it does
 *   - Exports the nvrtc* functions l2prefetch resolves (L2P_NVRTC_FUNCTIONS in
 *     csrc/nvrtc.h).  nvrtcVersion says 13.0; the supported archs are
 *     75 80 86 89 90 100 120.
 *   - "Compiles" without reading the source: the image is a few bytes that tell
 *     what arrived.  CUBIN: "\x7fELF" then "fake cubin for <name>\n" and one
 *     option per line.  PTX: "// fake ptx for <name>\n" and "// <option>" lines,
 *     NUL-terminated (the size counts the NUL, as NVRTC's does).  The log is
 *     "fake log for <name>".  An --gpu-architecture (or -arch) naming an arch not
 *     in the list fails with NVRTC_ERROR_INVALID_OPTION and says so in the log.
 *   - Counts calls per function and live programs (created minus destroyed);
 *     destroying an unknown or dead program returns NVRTC_ERROR_INVALID_PROGRAM
 *     and counts as a bad destroy.
 *   - Fails the Nth next call of any function on request (fakenvrtc_fail): the
 *     call returns the code at once, doing nothing else, and when it names a
 *     live program that program's log becomes "injected failure in <function>"
 *     (an injected nvrtcCompileProgram also leaves it uncompiled).
 *
 *   - Takes a set time per compile on request (fakenvrtc_set_compile_delay_us),
 *     sleeping before it takes its lock, so that compiles of several threads
 *     overlap as real ones do (the extension compiles without the GIL).
 *
 * Programs are encoded integers (kind << 48 | reset generation << 36 |
 * (index + 1) << 4), never dereferenced by callers.  One mutex guards
 * everything; counters are process-wide.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define EXPORT __attribute__((visibility("default")))

typedef int nvrtcResult;
typedef void *nvrtcProgram;

enum {
    OK = 0, E_OUT_OF_MEMORY = 1, E_PROGRAM_CREATION_FAILURE = 2, E_INVALID_INPUT = 3,
    E_INVALID_PROGRAM = 4, E_INVALID_OPTION = 5, E_COMPILATION = 6,
};

static const char *const error_names[] = {
    "NVRTC_SUCCESS",
    "NVRTC_ERROR_OUT_OF_MEMORY",
    "NVRTC_ERROR_PROGRAM_CREATION_FAILURE",
    "NVRTC_ERROR_INVALID_INPUT",
    "NVRTC_ERROR_INVALID_PROGRAM",
    "NVRTC_ERROR_INVALID_OPTION",
    "NVRTC_ERROR_COMPILATION",
    "NVRTC_ERROR_BUILTIN_OPERATION_FAILURE",
    "NVRTC_ERROR_NO_NAME_EXPRESSIONS_AFTER_COMPILATION",
    "NVRTC_ERROR_NO_LOWERED_NAMES_BEFORE_COMPILATION",
    "NVRTC_ERROR_NAME_EXPRESSION_NOT_VALID",
    "NVRTC_ERROR_INTERNAL_ERROR",
    "NVRTC_ERROR_TIME_FILE_WRITE_FAILED",
};
#define N_ERRORS (int)(sizeof error_names / sizeof *error_names)

static const int archs[] = {75, 80, 86, 89, 90, 100, 120};
#define N_ARCHS (int)(sizeof archs / sizeof *archs)

#define FUNCTIONS(X)                                                                     \
    X(nvrtcGetErrorString) X(nvrtcVersion) X(nvrtcGetNumSupportedArchs)                  \
    X(nvrtcGetSupportedArchs) X(nvrtcCreateProgram) X(nvrtcDestroyProgram)               \
    X(nvrtcCompileProgram) X(nvrtcGetProgramLogSize) X(nvrtcGetProgramLog)               \
    X(nvrtcGetPTXSize) X(nvrtcGetPTX) X(nvrtcGetCUBINSize) X(nvrtcGetCUBIN)

#define X_ENUM(n) F_##n,
enum { FUNCTIONS(X_ENUM) F_COUNT };
#define X_NAME(n) #n,
static const char *const fnames[F_COUNT] = {FUNCTIONS(X_NAME)};

/* ---- state ---------------------------------------------------------------- */

#define MAX_PENDING 256
#define KIND 0xAB

typedef struct {
    int live, compiled, ptx;   /* ptx: compiled for compute_XX (no CUBIN) */
    char *name, *log;
    char *cubin, *ptx_text;    /* set by a successful compile */
    size_t cubin_size, ptx_size;
} Prog;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct State {
    unsigned gen;
    int calls[F_COUNT];
    struct { int fn, target, code, active; } pending[MAX_PENDING];
    Prog *progs;
    size_t n, cap;
    long live, bad_destroys;
} S = {.gen = 1};

static void prog_free(Prog *p) {
    free(p->name);
    free(p->log);
    free(p->cubin);
    free(p->ptx_text);
    p->name = p->log = p->cubin = p->ptx_text = NULL;
}

static nvrtcProgram mkhandle(size_t idx) {
    return (nvrtcProgram)(uintptr_t)(((uint64_t)KIND << 48) | ((uint64_t)(S.gen & 0xfff) << 36) |
                                     ((uint64_t)(idx + 1) << 4));
}

/* The program behind a handle made since the last reset (live or dead), or NULL. */
static Prog *find(nvrtcProgram h) {
    uint64_t u = (uint64_t)(uintptr_t)h, idx = (u >> 4) & 0xffffffffu;
    if ((u >> 48) != KIND || ((u >> 36) & 0xfff) != (S.gen & 0xfff) || (u & 0xf) || idx == 0 ||
        idx > S.n)
        return NULL;
    return &S.progs[idx - 1];
}

static Prog *live_prog(nvrtcProgram h) {
    Prog *p = find(h);
    return p && p->live ? p : NULL;
}

static void set_log(Prog *p, const char *text) {
    char *copy = strdup(text);
    if (!copy) return;
    free(p->log);
    p->log = copy;
}

/* Counts the call; 1 (with *rc set) when an injected failure is due.  A live
 * program named by the call gets the failure in its log. */
static int gate(int fn, nvrtcProgram prog, nvrtcResult *rc) {
    int n = ++S.calls[fn];
    for (int i = 0; i < MAX_PENDING; i++)
        if (S.pending[i].active && S.pending[i].fn == fn && S.pending[i].target == n) {
            S.pending[i].active = 0;
            *rc = S.pending[i].code;
            Prog *p = prog ? live_prog(prog) : NULL;
            if (p) {
                char msg[128];
                snprintf(msg, sizeof msg, "injected failure in %s", fnames[fn]);
                set_log(p, msg);
                if (fn == F_nvrtcCompileProgram) p->compiled = 0;
            }
            return 1;
        }
    return 0;
}

#define LOCK() pthread_mutex_lock(&mu)
#define UNLOCK_RETURN(rc) do { nvrtcResult rc_ = (rc); pthread_mutex_unlock(&mu); return rc_; } while (0)
#define GATE(fn, prog)                                \
    nvrtcResult rc;                                   \
    LOCK();                                           \
    if (gate(F_##fn, (prog), &rc)) UNLOCK_RETURN(rc)

/* ---- a growing buffer ----------------------------------------------------- */

typedef struct { char *p; size_t len, cap; int oom; } Buf;

static void put(Buf *b, const void *data, size_t len) {
    if (b->oom) return;
    if (b->len + len + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (b->len + len + 1 > cap) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) { b->oom = 1; return; }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, data, len);
    b->len += len;
    b->p[b->len] = '\0';
}

static void puts_(Buf *b, const char *s) { put(b, s, strlen(s)); }

/* ---- entry points ---------------------------------------------------------- */

EXPORT const char *nvrtcGetErrorString(nvrtcResult r) {
    LOCK();
    S.calls[F_nvrtcGetErrorString]++;
    pthread_mutex_unlock(&mu);
    return r >= 0 && r < N_ERRORS ? error_names[r] : "NVRTC_ERROR unknown";
}

EXPORT nvrtcResult nvrtcVersion(int *major, int *minor) {
    GATE(nvrtcVersion, NULL);
    if (!major || !minor) UNLOCK_RETURN(E_INVALID_INPUT);
    *major = 13;
    *minor = 0;
    UNLOCK_RETURN(OK);
}

EXPORT nvrtcResult nvrtcGetNumSupportedArchs(int *n) {
    GATE(nvrtcGetNumSupportedArchs, NULL);
    if (!n) UNLOCK_RETURN(E_INVALID_INPUT);
    *n = N_ARCHS;
    UNLOCK_RETURN(OK);
}

EXPORT nvrtcResult nvrtcGetSupportedArchs(int *out) {
    GATE(nvrtcGetSupportedArchs, NULL);
    if (!out) UNLOCK_RETURN(E_INVALID_INPUT);
    memcpy(out, archs, sizeof archs);
    UNLOCK_RETURN(OK);
}

EXPORT nvrtcResult nvrtcCreateProgram(nvrtcProgram *prog, const char *src, const char *name,
                                      int num_headers, const char *const *headers,
                                      const char *const *include_names) {
    GATE(nvrtcCreateProgram, NULL);
    (void)headers;
    (void)include_names;
    if (!prog) UNLOCK_RETURN(E_INVALID_PROGRAM);
    if (!src || num_headers < 0) UNLOCK_RETURN(E_INVALID_INPUT);
    if (S.n == S.cap) {
        size_t cap = S.cap ? 2 * S.cap : 64;
        Prog *v = realloc(S.progs, cap * sizeof *v);
        if (!v) UNLOCK_RETURN(E_OUT_OF_MEMORY);
        S.progs = v;
        S.cap = cap;
    }
    Prog *p = &S.progs[S.n];
    memset(p, 0, sizeof *p);
    if (!(p->name = strdup(name ? name : "default_program"))) UNLOCK_RETURN(E_OUT_OF_MEMORY);
    p->live = 1;
    *prog = mkhandle(S.n++);
    S.live++;
    UNLOCK_RETURN(OK);
}

EXPORT nvrtcResult nvrtcDestroyProgram(nvrtcProgram *prog) {
    GATE(nvrtcDestroyProgram, prog ? *prog : NULL);
    if (!prog) UNLOCK_RETURN(E_INVALID_PROGRAM);
    Prog *p = live_prog(*prog);
    if (!p) {
        S.bad_destroys++;
        UNLOCK_RETURN(E_INVALID_PROGRAM);
    }
    prog_free(p);
    p->live = 0;
    S.live--;
    *prog = NULL;
    UNLOCK_RETURN(OK);
}

/* The arch of an --gpu-architecture / -arch option: 1 and *num, *ptx set; 0 if
 * opt is another option. */
static int arch_option(const char *opt, int *num, int *ptx) {
    const char *v = NULL;
    if (!strncmp(opt, "--gpu-architecture=", 19)) v = opt + 19;
    else if (!strncmp(opt, "-arch=", 6)) v = opt + 6;
    if (!v) return 0;
    *ptx = !strncmp(v, "compute_", 8);
    if (!*ptx && strncmp(v, "sm_", 3)) { *num = -1; return 1; }
    *num = atoi(v + (*ptx ? 8 : 3));
    return 1;
}

static long compile_delay_us; /* read without the lock: set by the test before it compiles */

EXPORT nvrtcResult nvrtcCompileProgram(nvrtcProgram prog, int num_options, const char *const *options) {
    if (compile_delay_us > 0) {
        struct timespec t = {compile_delay_us / 1000000, (compile_delay_us % 1000000) * 1000};
        nanosleep(&t, NULL);
    }
    GATE(nvrtcCompileProgram, prog);
    Prog *p = live_prog(prog);
    if (!p) UNLOCK_RETURN(E_INVALID_PROGRAM);
    if (num_options < 0 || (num_options > 0 && !options)) UNLOCK_RETURN(E_INVALID_INPUT);
    free(p->cubin);
    free(p->ptx_text);
    p->cubin = p->ptx_text = NULL;
    p->compiled = p->ptx = 0;
    for (int i = 0; i < num_options; i++) {
        int num = 0, ptx = 0, known = 0;
        if (!options[i]) UNLOCK_RETURN(E_INVALID_INPUT);
        if (!arch_option(options[i], &num, &ptx)) continue;
        for (int a = 0; a < N_ARCHS; a++) known |= archs[a] == num;
        if (!known) {
            char msg[256];
            snprintf(msg, sizeof msg, "nvrtc: error: invalid value for --gpu-architecture (-arch) in %s",
                     options[i]);
            set_log(p, msg);
            UNLOCK_RETURN(E_INVALID_OPTION);
        }
        p->ptx = ptx;
    }
    Buf cubin = {0}, text = {0};
    put(&cubin, "\x7f" "ELF", 4);
    puts_(&cubin, "fake cubin for ");
    puts_(&cubin, p->name);
    puts_(&text, "// fake ptx for ");
    puts_(&text, p->name);
    for (int i = 0; i < num_options; i++) {
        puts_(&cubin, "\n");
        puts_(&cubin, options[i]);
        puts_(&text, "\n// ");
        puts_(&text, options[i]);
    }
    puts_(&cubin, "\n");
    puts_(&text, "\n");
    char log[256];
    snprintf(log, sizeof log, "fake log for %s", p->name);
    if (cubin.oom || text.oom) {
        free(cubin.p);
        free(text.p);
        UNLOCK_RETURN(E_OUT_OF_MEMORY);
    }
    set_log(p, log);
    p->cubin = cubin.p;
    p->cubin_size = cubin.len;
    p->ptx_text = text.p;
    p->ptx_size = text.len + 1; /* with the NUL */
    p->compiled = 1;
    UNLOCK_RETURN(OK);
}

EXPORT nvrtcResult nvrtcGetProgramLogSize(nvrtcProgram prog, size_t *size) {
    GATE(nvrtcGetProgramLogSize, prog);
    Prog *p = live_prog(prog);
    if (!p) UNLOCK_RETURN(E_INVALID_PROGRAM);
    if (!size) UNLOCK_RETURN(E_INVALID_INPUT);
    *size = (p->log ? strlen(p->log) : 0) + 1;
    UNLOCK_RETURN(OK);
}

EXPORT nvrtcResult nvrtcGetProgramLog(nvrtcProgram prog, char *log) {
    GATE(nvrtcGetProgramLog, prog);
    Prog *p = live_prog(prog);
    if (!p) UNLOCK_RETURN(E_INVALID_PROGRAM);
    if (!log) UNLOCK_RETURN(E_INVALID_INPUT);
    strcpy(log, p->log ? p->log : "");
    UNLOCK_RETURN(OK);
}

EXPORT nvrtcResult nvrtcGetPTXSize(nvrtcProgram prog, size_t *size) {
    GATE(nvrtcGetPTXSize, prog);
    Prog *p = live_prog(prog);
    if (!p) UNLOCK_RETURN(E_INVALID_PROGRAM);
    if (!size || !p->compiled) UNLOCK_RETURN(E_INVALID_INPUT);
    *size = p->ptx_size;
    UNLOCK_RETURN(OK);
}

EXPORT nvrtcResult nvrtcGetPTX(nvrtcProgram prog, char *out) {
    GATE(nvrtcGetPTX, prog);
    Prog *p = live_prog(prog);
    if (!p) UNLOCK_RETURN(E_INVALID_PROGRAM);
    if (!out || !p->compiled) UNLOCK_RETURN(E_INVALID_INPUT);
    memcpy(out, p->ptx_text, p->ptx_size);
    UNLOCK_RETURN(OK);
}

/* A program compiled for compute_XX has no CUBIN: size 0, as with NVRTC. */
EXPORT nvrtcResult nvrtcGetCUBINSize(nvrtcProgram prog, size_t *size) {
    GATE(nvrtcGetCUBINSize, prog);
    Prog *p = live_prog(prog);
    if (!p) UNLOCK_RETURN(E_INVALID_PROGRAM);
    if (!size || !p->compiled) UNLOCK_RETURN(E_INVALID_INPUT);
    *size = p->ptx ? 0 : p->cubin_size;
    UNLOCK_RETURN(OK);
}

EXPORT nvrtcResult nvrtcGetCUBIN(nvrtcProgram prog, char *out) {
    GATE(nvrtcGetCUBIN, prog);
    Prog *p = live_prog(prog);
    if (!p) UNLOCK_RETURN(E_INVALID_PROGRAM);
    if (!out || !p->compiled) UNLOCK_RETURN(E_INVALID_INPUT);
    if (!p->ptx) memcpy(out, p->cubin, p->cubin_size);
    UNLOCK_RETURN(OK);
}

/* ---- control API (tests, through ctypes) ----------------------------------- */

static int fn_index(const char *name) {
    for (int i = 0; name && i < F_COUNT; i++)
        if (!strcmp(fnames[i], name)) return i;
    return -1;
}

/* Forgets every program (live ones too), counter and pending failure. */
/* Each nvrtcCompileProgram first sleeps us microseconds (0: none; reset() keeps it). */
EXPORT void fakenvrtc_set_compile_delay_us(long us) { compile_delay_us = us; }

EXPORT void fakenvrtc_reset(void) {
    pthread_mutex_lock(&mu);
    for (size_t i = 0; i < S.n; i++) prog_free(&S.progs[i]);
    free(S.progs);
    S = (struct State){.gen = S.gen + 1};
    pthread_mutex_unlock(&mu);
}

/* The nth next call (1 = the very next) of `name` returns code.  0, or -1 for an
 * unknown function, nvrtcGetErrorString (it returns no status), nth < 1 or too
 * many pending. */
EXPORT int fakenvrtc_fail(const char *name, int nth, int code) {
    int fn = fn_index(name), rc = -1;
    if (fn < 0 || fn == F_nvrtcGetErrorString || nth < 1) return -1;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < MAX_PENDING && rc; i++)
        if (!S.pending[i].active) {
            S.pending[i].active = 1;
            S.pending[i].fn = fn;
            S.pending[i].target = S.calls[fn] + nth;
            S.pending[i].code = code;
            rc = 0;
        }
    pthread_mutex_unlock(&mu);
    return rc;
}

EXPORT int fakenvrtc_calls(const char *name) { /* -1 for an unknown function */
    int fn = fn_index(name), n = -1;
    if (fn < 0) return -1;
    pthread_mutex_lock(&mu);
    n = S.calls[fn];
    pthread_mutex_unlock(&mu);
    return n;
}

EXPORT long fakenvrtc_live_programs(void) {
    pthread_mutex_lock(&mu);
    long n = S.live;
    pthread_mutex_unlock(&mu);
    return n;
}

EXPORT long fakenvrtc_bad_destroys(void) {
    pthread_mutex_lock(&mu);
    long n = S.bad_destroys;
    pthread_mutex_unlock(&mu);
    return n;
}
