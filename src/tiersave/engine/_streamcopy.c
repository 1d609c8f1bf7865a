/*
 * Host-to-host copies with non-temporal stores, for staging (engine/memcopy.py loads this with ctypes).
 *
 * Why: glibc's memmove copies 1-240 MiB with a loop of ordinary stores (non-temporal ones only above a
 * threshold of about three quarters of the last-level cache per thread, times the threads); every ordinary
 * store first reads its cache line into the cache (read for ownership), so a copy of cold memory moves each
 * destination byte over the memory bus twice. Staging copies a whole state; the writers read it back (the
 * CRC, a buffered write) only after the rest of the state has gone through the cache, so for a state many
 * times the cache's size the read comes from memory either way, and streaming stores save the first read.
 * engine/stage.py streams only copies of at least _STREAM_MIN bytes in total for that reason. Recorded
 * (benchmarks/results/stream-20261125/memmove_pieces.txt, AMD EPYC, 256 MiB in 8 MiB pieces): one thread
 * 8.8 GB/s with memmove, 15.0 with the AVX2 loop; the bench's 3 GB state on two threads 193 ms against 132.
 *
 * One exported copy, plus its ABI number, the SHA-256 of the source it was built from (the loader refuses a
 * library built from another source: a stale build in an editable install) and the name of the loop chosen
 * at load time: AVX2 where the CPU has it, else SSE2 (TIERSAVE_STREAM_LOOP=sse2 in the environment when the
 * library is loaded forces SSE2, for tests). No Python headers, so one build serves every Python version. The
 * ranges must not overlap (staging never overlaps); an overlap, or a copy under SMALL bytes, is handed to
 * memmove, which is correct for every input.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(__x86_64__)
#error "tiersave's streaming copy is written for x86-64; other machines stage with memmove"
#endif

#include <immintrin.h>

#define EXPORT __attribute__((visibility("default")))
#define SMALL ((size_t)256 << 10) /* below this the copy is likely cache-resident: memmove keeps it there */
#define LINE 64                   /* destination alignment: whole cache lines fill the write-combining buffers */
#define BLOCK 128                 /* bytes per loop iteration in both loops */

#ifndef TIERSAVE_STREAMCOPY_SOURCE
#define TIERSAVE_STREAMCOPY_SOURCE "unknown" /* hatch_build.py defines it: the SHA-256 of this file */
#endif

static void stream_sse2(unsigned char *d, const unsigned char *s, size_t n) {
    for (; n; n -= BLOCK, d += BLOCK, s += BLOCK) {
        for (int k = 0; k < BLOCK; k += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(s + k));
            __m128i b = _mm_loadu_si128((const __m128i *)(s + k + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + k + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + k + 48));
            _mm_stream_si128((__m128i *)(d + k), a);
            _mm_stream_si128((__m128i *)(d + k + 16), b);
            _mm_stream_si128((__m128i *)(d + k + 32), c);
            _mm_stream_si128((__m128i *)(d + k + 48), e);
        }
    }
}

__attribute__((target("avx2"))) static void stream_avx2(unsigned char *d, const unsigned char *s, size_t n) {
    for (; n; n -= BLOCK, d += BLOCK, s += BLOCK) {
        __m256i a = _mm256_loadu_si256((const __m256i *)s);
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(s + 64));
        __m256i e = _mm256_loadu_si256((const __m256i *)(s + 96));
        _mm256_stream_si256((__m256i *)d, a);
        _mm256_stream_si256((__m256i *)(d + 32), b);
        _mm256_stream_si256((__m256i *)(d + 64), c);
        _mm256_stream_si256((__m256i *)(d + 96), e);
    }
}

static void (*stream_body)(unsigned char *, const unsigned char *, size_t) = stream_sse2;
static const char *stream_kind = "sse2";

__attribute__((constructor)) static void pick_loop(void) {
    __builtin_cpu_init();
    const char *forced = getenv("TIERSAVE_STREAM_LOOP");
    if (forced != NULL && strcmp(forced, "sse2") == 0)
        return;
    if (__builtin_cpu_supports("avx2")) {
        stream_body = stream_avx2;
        stream_kind = "avx2";
    }
}

/* Bumped whenever an exported signature changes: the loader refuses a library built from another version. */
EXPORT int tiersave_stream_copy_abi(void) { return 1; }

EXPORT const char *tiersave_stream_copy_kind(void) { return stream_kind; }

EXPORT const char *tiersave_stream_copy_source(void) { return TIERSAVE_STREAMCOPY_SOURCE; }

EXPORT void tiersave_stream_copy(void *dst, const void *src, size_t n) {
    unsigned char *d = dst;
    const unsigned char *s = src;
    uintptr_t di = (uintptr_t)d, si = (uintptr_t)s;
    if (n < SMALL || (di < si + n && si < di + n)) { /* integers: pointers into two objects do not compare */
        memmove(d, s, n);
        return;
    }
    size_t head = (size_t)(-(uintptr_t)d) & (LINE - 1);
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    size_t body = n & ~(size_t)(BLOCK - 1);
    stream_body(d, s, body);
    _mm_sfence(); /* the streamed stores are visible to other threads before this call returns */
    memcpy(d + body, s + body, n - body);
}
