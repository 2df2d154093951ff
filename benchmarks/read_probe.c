// The memory read bandwidth probe of benchmarks/bandwidth.py: `threads` threads each read their
// own contiguous slice of one buffer (much larger than the last-level cache) with the widest
// vector loads this CPU has, OR-reducing them so no load is dead. Built by bandwidth.py with
// the system C compiler for this CPU (-O3 -march=native -pthread).

#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct {
  const uint8_t* begin;
  size_t bytes;
  pthread_barrier_t* start;
  uint64_t sink;
} Slice;

static uint64_t ReadSlice(const uint8_t* p, size_t bytes) {
#if defined(__AVX512F__)
  __m512i a = _mm512_setzero_si512(), b = a, c = a, d = a;
  for (size_t i = 0; i + 256 <= bytes; i += 256) {
    a = _mm512_or_si512(a, _mm512_load_si512((const void*)(p + i)));
    b = _mm512_or_si512(b, _mm512_load_si512((const void*)(p + i + 64)));
    c = _mm512_or_si512(c, _mm512_load_si512((const void*)(p + i + 128)));
    d = _mm512_or_si512(d, _mm512_load_si512((const void*)(p + i + 192)));
  }
  return (uint64_t)_mm512_reduce_or_epi64(_mm512_or_si512(_mm512_or_si512(a, b), _mm512_or_si512(c, d)));
#elif defined(__AVX2__)
  __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
  for (size_t i = 0; i + 128 <= bytes; i += 128) {
    a = _mm256_or_si256(a, _mm256_load_si256((const __m256i*)(p + i)));
    b = _mm256_or_si256(b, _mm256_load_si256((const __m256i*)(p + i + 32)));
    c = _mm256_or_si256(c, _mm256_load_si256((const __m256i*)(p + i + 64)));
    d = _mm256_or_si256(d, _mm256_load_si256((const __m256i*)(p + i + 96)));
  }
  __m256i r = _mm256_or_si256(_mm256_or_si256(a, b), _mm256_or_si256(c, d));
  uint64_t out[4];
  _mm256_storeu_si256((__m256i*)out, r);
  return out[0] | out[1] | out[2] | out[3];
#else
  uint64_t r = 0;
  for (size_t i = 0; i + 8 <= bytes; i += 8) {
    uint64_t v;
    memcpy(&v, p + i, sizeof v);
    r |= v;
  }
  return r;
#endif
}

volatile uint64_t g_sink;  // every slice's OR, so that no read is dead

static void* Run(void* arg) {
  Slice* s = (Slice*)arg;
  pthread_barrier_wait(s->start);
  s->sink = ReadSlice(s->begin, s->bytes);
  return NULL;
}

static double Now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

// The best of `reps` reads of a `bytes` buffer (written once first) by `threads` threads, in
// bytes per second; 0 on an allocation failure.
double ReadBandwidth(size_t bytes, int threads, int reps) {
  if (threads < 1) threads = 1;
  bytes = bytes / (256 * (size_t)threads) * 256 * (size_t)threads;
  uint8_t* buf = (uint8_t*)aligned_alloc(4096, bytes);
  if (buf == NULL) return 0.0;
  for (size_t i = 0; i < bytes; ++i) buf[i] = (uint8_t)(i * 2654435761u >> 24);
  Slice* slices = (Slice*)calloc((size_t)threads, sizeof(Slice));
  pthread_t* ids = (pthread_t*)calloc((size_t)threads, sizeof(pthread_t));
  pthread_barrier_t start;
  double best = 0.0;
  for (int r = 0; r < reps; ++r) {
    pthread_barrier_init(&start, NULL, (unsigned)threads + 1);
    for (int t = 0; t < threads; ++t) {
      slices[t].begin = buf + bytes / (size_t)threads * (size_t)t;
      slices[t].bytes = bytes / (size_t)threads;
      slices[t].start = &start;
      pthread_create(&ids[t], NULL, Run, &slices[t]);
    }
    pthread_barrier_wait(&start);
    const double t0 = Now();
    for (int t = 0; t < threads; ++t) pthread_join(ids[t], NULL);
    const double rate = (double)bytes / (Now() - t0);
    for (int t = 0; t < threads; ++t) g_sink |= slices[t].sink;
    pthread_barrier_destroy(&start);
    if (rate > best) best = rate;
  }
  free(ids);
  free(slices);
  free(buf);
  return best;
}
