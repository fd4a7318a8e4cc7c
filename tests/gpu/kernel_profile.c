// A GPU profile for any CUDA program, through CUPTI's activity API, for machines where Nsight
// Systems cannot write a report: loaded as a CUDA injection library, it records every kernel,
// memory copy, memset and driver call, and at exit prints what a first look at a profile needs:
//   - the span from the first GPU activity to the last, the time the GPU was busy in it, and so
//     how much of the span the GPU sat waiting for the host;
//   - the kernels by total time (calls, total, mean, share of kernel time), and again split by
//     launch size (threads launched), which for candle's elementwise kernels is the element
//     count, so that one kernel name used by many ops splits into the tensors it ran over;
//   - memory copies by direction (calls, bytes, time), memsets;
//   - driver calls by total time (synchronisations, allocations, launches).
//
// Built by tests/gpu/build-cuda.sh (needs CUPTI's headers); on the GPU machine:
//   CUDA_INJECTION64_PATH=/tmp/gpubin/libkernel_profile.so KERNEL_PROFILE_OUT=profile.txt <program>
// with libcupti.so.13 on LD_LIBRARY_PATH (PyTorch's nvidia/cu13/lib has it).
#include <cupti.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BUFFER_BYTES (8u << 20)
#define TABLE_SLOTS 8192
#define TOP 40

typedef struct {
  const char *name; // owned copy
  uint64_t calls, ns;
} Row;

static Row kernels[TABLE_SLOTS], sized[TABLE_SLOTS], driver[TABLE_SLOTS];
static uint64_t copy_calls[16], copy_bytes[16], copy_ns[16], memset_calls, memset_ns;
static uint64_t first_start = UINT64_MAX, last_end, busy_ns, busy_until;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static uint64_t hash(const char *s) {
  uint64_t h = 1469598103934665603ull;
  for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
  return h;
}

static void add(Row *table, const char *name, uint64_t ns) {
  if (!name) name = "?";
  uint64_t i = hash(name) % TABLE_SLOTS;
  for (int probe = 0; probe < TABLE_SLOTS; probe++, i = (i + 1) % TABLE_SLOTS) {
    if (!table[i].name) table[i].name = strdup(name);
    if (strcmp(table[i].name, name) == 0) {
      table[i].calls++;
      table[i].ns += ns;
      return;
    }
  }
}

// The GPU's busy time as the union of activity intervals. Records of one buffer arrive in
// start order per stream; a single-stream program (candle's) gives an exact union.
static void span(uint64_t start, uint64_t end) {
  if (start == 0 || end <= start) return;
  if (start < first_start) first_start = start;
  if (end > last_end) last_end = end;
  if (start >= busy_until) {
    busy_ns += end - start;
    busy_until = end;
  } else if (end > busy_until) {
    busy_ns += end - busy_until;
    busy_until = end;
  }
}

static void CUPTIAPI requested(uint8_t **buffer, size_t *size, size_t *max_records) {
  *buffer = aligned_alloc(8, BUFFER_BYTES);
  *size = BUFFER_BYTES;
  *max_records = 0;
}

static void CUPTIAPI completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size, size_t valid) {
  (void)ctx, (void)stream, (void)size;
  CUpti_Activity *r = NULL;
  pthread_mutex_lock(&lock);
  while (cuptiActivityGetNextRecord(buffer, valid, &r) == CUPTI_SUCCESS) {
    switch (r->kind) {
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        CUpti_ActivityKernel10 *k = (CUpti_ActivityKernel10 *)r;
        add(kernels, k->name, k->end - k->start);
        char key[160];
        unsigned long long threads = (unsigned long long)k->gridX * k->gridY * k->gridZ * k->blockX * k->blockY * k->blockZ;
        snprintf(key, sizeof key, "%.100s [%llu threads]", k->name ? k->name : "?", threads);
        add(sized, key, k->end - k->start);
        span(k->start, k->end);
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        CUpti_ActivityMemcpy6 *m = (CUpti_ActivityMemcpy6 *)r;
        int kind = m->copyKind & 15;
        copy_calls[kind]++;
        copy_bytes[kind] += m->bytes;
        copy_ns[kind] += m->end - m->start;
        span(m->start, m->end);
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        CUpti_ActivityMemset4 *m = (CUpti_ActivityMemset4 *)r;
        memset_calls++;
        memset_ns += m->end - m->start;
        span(m->start, m->end);
        break;
      }
      case CUPTI_ACTIVITY_KIND_DRIVER: {
        CUpti_ActivityAPI *a = (CUpti_ActivityAPI *)r;
        const char *name = NULL;
        cuptiGetCallbackName(CUPTI_CB_DOMAIN_DRIVER_API, a->cbid, &name);
        add(driver, name, a->end - a->start);
        break;
      }
      default:
        break;
    }
  }
  pthread_mutex_unlock(&lock);
  free(buffer);
}

static int by_time(const void *a, const void *b) {
  uint64_t x = ((const Row *)a)->ns, y = ((const Row *)b)->ns;
  return x < y ? 1 : x > y ? -1 : 0;
}

static void table(FILE *out, const char *title, Row *rows, uint64_t total) {
  qsort(rows, TABLE_SLOTS, sizeof(Row), by_time);
  fprintf(out, "\n%s\n| calls | total ms | mean us | share | name |\n|---|---|---|---|---|\n", title);
  for (int i = 0; i < TOP && rows[i].name; i++) {
    fprintf(out, "| %llu | %.1f | %.1f | %.1f%% | %.110s |\n", (unsigned long long)rows[i].calls, rows[i].ns / 1e6,
            rows[i].ns / 1e3 / rows[i].calls, total ? 100.0 * rows[i].ns / total : 0.0, rows[i].name);
  }
}

static void report(void) {
  cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  const char *path = getenv("KERNEL_PROFILE_OUT");
  FILE *out = path ? fopen(path, "w") : stderr;
  if (!out) out = stderr;
  pthread_mutex_lock(&lock);
  uint64_t kernel_ns = 0, kernel_calls = 0, driver_ns = 0;
  for (int i = 0; i < TABLE_SLOTS; i++) {
    kernel_ns += kernels[i].ns, kernel_calls += kernels[i].calls, driver_ns += driver[i].ns;
  }
  double wall = last_end > first_start ? (last_end - first_start) / 1e6 : 0.0;
  fprintf(out, "GPU activity span %.1f ms, GPU busy %.1f ms (%.1f%%): kernels %.1f ms in %llu launches (mean %.1f us)\n", wall,
          busy_ns / 1e6, wall > 0 ? 100.0 * busy_ns / 1e6 / wall : 0.0, kernel_ns / 1e6, (unsigned long long)kernel_calls,
          kernel_calls ? kernel_ns / 1e3 / kernel_calls : 0.0);
  const char *kinds[16] = {[1] = "HtoD", [2] = "DtoH", [8] = "DtoD", [9] = "HtoH", [10] = "PtoP"};
  for (int k = 0; k < 16; k++) {
    if (copy_calls[k]) {
      fprintf(out, "memcpy %s: %llu calls, %.1f MB, %.1f ms\n", kinds[k] ? kinds[k] : "other", (unsigned long long)copy_calls[k],
              copy_bytes[k] / 1e6, copy_ns[k] / 1e6);
    }
  }
  fprintf(out, "memset: %llu calls, %.1f ms\n", (unsigned long long)memset_calls, memset_ns / 1e6);
  table(out, "Kernels by total time", kernels, kernel_ns);
  table(out, "Kernels by name and launch size", sized, kernel_ns);
  table(out, "Driver calls by total time (host side)", driver, driver_ns);
  pthread_mutex_unlock(&lock);
  if (out != stderr) fclose(out);
}

int InitializeInjection(void) {
  cuptiActivityRegisterCallbacks(requested, completed);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_DRIVER);
  atexit(report);
  return 1;
}
