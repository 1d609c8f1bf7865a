/*
 * Host-to-host copies with non-temporal stores, for staging (engine/memcopy.py loads this with ctypes).
 *
 * Why: glibc's memmove copies 1-240 MiB with a loop of ordinary stores (non-temporal ones only above a
 * threshold of about three quarters of the last-level cache per thread, times the threads); every ordinary
 * store first reads its cache line into the cache (read for ownership), so a copy of cold memory moves each
 * destination byte over the memory bus twice, and evicts the cache the training loop is using. Staging writes
 * a whole state once and nothing reads it back soon (the writers' direct I/O reads it by DMA), which is what
 * non-temporal stores are for. Timed once on this project's development machine (AMD EPYC, one thread, 1 GiB in
 * 8 MiB pieces): memmove 10.3 GB/s, SSE2 streaming stores 18.7, AVX2 20.4.
 *
 * One exported copy (plus its ABI number and the name of the loop chosen at load time); no Python headers,
 * so one build serves every Python version. The ranges must not overlap (staging never overlaps); an overlap,
 * or a copy under SMALL bytes, is handed to memmove, which is correct for every input.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if !defined(__x86_64__)
#error "tiersave's streaming copy is written for x86-64; other machines stage with memmove"
#endif

#include <immintrin.h>

#define EXPORT __attribute__((visibility("default")))
#define SMALL ((size_t)256 << 10) /* below this the copy is likely cache-resident: memmove keeps it there */
#define LINE 64                   /* destination alignment: whole cache lines fill the write-combining buffers */
#define BLOCK 128                 /* bytes per loop iteration in both loops */

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
    if (__builtin_cpu_supports("avx2")) {
        stream_body = stream_avx2;
        stream_kind = "avx2";
    }
}

/* Bumped whenever an exported signature changes: the loader refuses a library built from another version. */
EXPORT int tiersave_stream_copy_abi(void) { return 1; }

EXPORT const char *tiersave_stream_copy_kind(void) { return stream_kind; }

EXPORT void tiersave_stream_copy(void *dst, const void *src, size_t n) {
    unsigned char *d = dst;
    const unsigned char *s = src;
    if (n < SMALL || (d < s + n && s < d + n)) {
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
