/* FedFit's page pool: the training child's large blocks, reused within the live high-water mark.
 *
 * Preloaded (LD_PRELOAD) into the training forkserver, it passes every allocation to glibc until a process calls
 * fedfit_pool_enable(threshold) (edge_agent.allocator does, in the training child). From then on every block of
 * at least `threshold` bytes is a mapping of its own, as with glibc's mmap threshold fixed at one page (the
 * "compact" heap), but a freed block is not unmapped: its pages are kept and handed to a later request, of the
 * same length as they are, or shrunk or grown in place with mremap (the pages kept keep their contents; only a
 * grown tail is new). What is kept never exceeds the high-water mark of the live blocks since the last
 * fedfit_pool_release(): before a request would take live + kept above it, the oldest kept blocks are unmapped.
 * A large block freed with pages it never wrote counts, kept and when its length is asked for again, as what it
 * wrote, and the high-water mark loses the rest (pool_free, expected_written); it serves only its own length. So
 * the resident peak is the compact heap's, while the pages a step reuses are not faulted in again. Nothing is populated: fresh pages fault in as written, which costs speed
 * on large activations (docs/edge-runtime.md) but keeps unwritten scratch out of the peak (the test
 * test_a_block_written_in_part_is_resident_only_where_written).
 *
 * Threads: one mutex guards the pool; frees of blocks outside the pool's address range never take it.
 *
 * Limits: what is kept is bounded by the pooled blocks' own high-water mark, not the process's: glibc's small
 * blocks (under the threshold) that peak later sit on top of it. In a training child, whose small blocks stay
 * few and steady, the measured peaks match the compact heap's (benchmarks/memory.py).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

extern void *__libc_malloc(size_t size);
extern void __libc_free(void *ptr);
extern void *__libc_calloc(size_t count, size_t size);
extern void *__libc_realloc(void *ptr, size_t size);
extern void *__libc_memalign(size_t alignment, size_t size);
extern void *__libc_valloc(size_t size);
extern void *__libc_pvalloc(size_t size);

#define HEADER 64 /* the user pointer's offset into its mapping: torch asks for 64-byte alignment */

/* user == 0: empty, 1: deleted; `counted`: what the block adds to live_bytes (its length, or what a block of
 * that length was seen to write: sparse_written) */
typedef struct { uintptr_t user; uintptr_t base; size_t length; size_t counted; } Entry;
typedef struct { uintptr_t base; size_t length; size_t counted; } Kept; /* counted: in kept_bytes */

static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static volatile int enabled;
static size_t threshold = SIZE_MAX;
static size_t page_size = 4096;
static uintptr_t range_lo = UINTPTR_MAX, range_hi; /* only widened, under the lock; read without it */

static Entry *table;          /* open addressing on the user pointer */
static size_t table_capacity; /* a power of two */
static size_t table_used;     /* live entries and deleted marks */
static size_t table_live;     /* live entries */
static Kept *kept;            /* kept blocks, oldest first */
static size_t kept_count, kept_capacity;

static size_t live_bytes, kept_bytes, high_water;
static uint64_t maps_made, bytes_mapped, blocks_served; /* blocks_served: pooled allocations */

/* Lengths of blocks freed with pages they never wrote, and how many bytes the last of each wrote: a block of such
 * a length counts as that much (live, and against the high-water mark), not as its mapped length. */
#define SPARSE_SIZES 32
typedef struct { size_t length; size_t written; } Sparse;
static Sparse sparse[SPARSE_SIZES];
static size_t sparse_next; /* the slot a new length takes (the oldest) */

/* Fresh zero pages, not populated: a page becomes resident when it is first written, as with the compact heap.
 * Requests are often larger than what is written (oneDNN's GEMM convolutions on AVX2 book a weight gradient per
 * thread it might run and write one: populating that scratch made a CNN step's peak 13 MB higher on 8x8 inputs,
 * and the step slower). */
static void *map_pages(size_t length) {
    void *p = mmap(NULL, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

/* A well-mixed hash of a pointer (splitmix64's finaliser): pointers share their low bits. */
static size_t hash(uintptr_t key) {
    uint64_t x = (uint64_t)key;
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBull;
    x ^= x >> 31;
    return (size_t)x;
}

static int table_resize(size_t capacity) {
    Entry *fresh = map_pages(capacity * sizeof(Entry));
    if (fresh == NULL) return -1;
    for (size_t i = 0; i < table_capacity; i++) {
        if (table[i].user > 1) {
            size_t j = hash(table[i].user) & (capacity - 1);
            while (fresh[j].user != 0) j = (j + 1) & (capacity - 1);
            fresh[j] = table[i];
        }
    }
    if (table != NULL) munmap(table, table_capacity * sizeof(Entry));
    table = fresh;
    table_capacity = capacity;
    table_used = table_live;
    return 0;
}

/* Room for one more entry (resizing when half the slots are used); -1 where no memory could be had. */
static int table_reserve(void) {
    if ((table_used + 1) * 2 <= table_capacity) return 0;
    size_t capacity = 4096; /* room for twice the live entries, deleted marks dropped */
    while (capacity < 4 * (table_live + 1)) capacity *= 2;
    return table_resize(capacity);
}

static int table_insert(uintptr_t user, uintptr_t base, size_t length, size_t counted) {
    if (table_reserve() != 0) return -1;
    size_t i = hash(user) & (table_capacity - 1);
    while (table[i].user > 1) i = (i + 1) & (table_capacity - 1);
    if (table[i].user == 0) table_used++;
    table_live++;
    table[i] = (Entry){user, base, length, counted};
    return 0;
}

static Entry *table_find(uintptr_t user) {
    if (table_capacity == 0) return NULL;
    size_t i = hash(user) & (table_capacity - 1);
    while (table[i].user != 0) {
        if (table[i].user == user) return &table[i];
        i = (i + 1) & (table_capacity - 1);
    }
    return NULL;
}

static int kept_push(uintptr_t base, size_t length, size_t counted) {
    if (kept_count == kept_capacity) {
        size_t capacity = kept_capacity ? kept_capacity * 2 : 1024;
        Kept *fresh = map_pages(capacity * sizeof(Kept));
        if (fresh == NULL) return -1;
        if (kept != NULL) {
            memcpy(fresh, kept, kept_count * sizeof(Kept));
            munmap(kept, kept_capacity * sizeof(Kept));
        }
        kept = fresh;
        kept_capacity = capacity;
    }
    kept[kept_count++] = (Kept){base, length, counted};
    kept_bytes += counted;
    return 0;
}

static Kept kept_take(size_t index) {
    Kept block = kept[index];
    memmove(&kept[index], &kept[index + 1], (kept_count - index - 1) * sizeof(Kept));
    kept_count--;
    kept_bytes -= block.counted;
    return block;
}

/* Unmap the oldest kept blocks until `length` more bytes fit under the high-water mark (or none is kept). */
static void make_room(size_t length) {
    while (kept_count > 0 && live_bytes + kept_bytes + length > high_water) {
        Kept block = kept_take(0);
        munmap((void *)block.base, block.length);
    }
}

static void note_range(uintptr_t base, size_t length) {
    if (base < range_lo) __atomic_store_n(&range_lo, base, __ATOMIC_RELAXED);
    if (base + length > range_hi) __atomic_store_n(&range_hi, base + length, __ATOMIC_RELAXED);
}

/* Whether `user` may be a pooled block (a pointer another thread got from the pool is always in range). */
static int in_range(uintptr_t user) {
    return user >= __atomic_load_n(&range_lo, __ATOMIC_RELAXED) && user < __atomic_load_n(&range_hi, __ATOMIC_RELAXED);
}

/* A block of `length` bytes (a whole number of pages): kept pages where possible. *dirty receives how many of its
 * leading bytes may be non-zero (the rest are fresh pages). Called with the lock held. */
static uintptr_t obtain(size_t length, size_t counted, size_t *dirty) {
    size_t exact = SIZE_MAX, larger = SIZE_MAX, smaller = SIZE_MAX;
    for (size_t i = kept_count; i-- > 0;) {
        size_t have = kept[i].length;
        /* (A block of a length known to be written in part, kept whole, would be resident beyond what it counts.) */
        if (have == length && (counted == length || kept[i].counted <= counted)) { exact = i; break; }
        /* A block written in part serves its own length only (its resident pages are what it is counted as), and a
         * length known to be written in part takes no other block's pages (they are resident). */
        if (counted < length || kept[i].counted < have) continue;
        if (have > length && (larger == SIZE_MAX || have < kept[larger].length)) larger = i;
        if (have < length && (smaller == SIZE_MAX || have > kept[smaller].length)) smaller = i;
    }
    *dirty = length;
    if (exact != SIZE_MAX) return kept_take(exact).base;
    if (larger != SIZE_MAX) {
        Kept block = kept_take(larger);
        munmap((void *)(block.base + length), block.length - length); /* the tail goes back to the system */
        return block.base;
    }
    if (smaller != SIZE_MAX) {
        Kept block = kept_take(smaller);
        make_room(counted); /* the block is counted in neither live nor kept while it is out */
        void *moved = mremap((void *)block.base, block.length, length, MREMAP_MAYMOVE);
        if (moved != MAP_FAILED) {
            maps_made++;
            bytes_mapped += length - block.length;
            note_range((uintptr_t)moved, length);
            *dirty = block.length;
            return (uintptr_t)moved;
        }
        munmap((void *)block.base, block.length);
    }
    make_room(counted);
    void *p = map_pages(length);
    if (p == NULL) return 0;
    maps_made++;
    bytes_mapped += length;
    note_range((uintptr_t)p, length);
    *dirty = 0;
    return (uintptr_t)p;
}

/* Blocks of at least this many bytes are checked for pages never written when they are freed. */
#define SPARSE_CHECK_BYTES ((size_t)1 << 20)

/* What a block of `length` bytes is counted as: what the last one of that length wrote, when one was freed with
 * pages it never wrote; else its length. Called with the lock held. */
static size_t expected_written(size_t length) {
    if (length < SPARSE_CHECK_BYTES) return length;
    for (size_t i = 0; i < SPARSE_SIZES; i++)
        if (sparse[i].length == length) return sparse[i].written;
    return length;
}

/* Remember what a freed block of `length` bytes wrote (only lengths once seen written in part), a page at least.
 * Lock held. */
static void learn_written(size_t length, size_t written) {
    if (written < page_size) written = page_size;
    for (size_t i = 0; i < SPARSE_SIZES; i++) {
        if (sparse[i].length == length) {
            sparse[i].written = written;
            return;
        }
    }
    if (length - written <= page_size) return; /* written through: counted as its length anyway */
    sparse[sparse_next] = (Sparse){length, written};
    sparse_next = (sparse_next + 1) % SPARSE_SIZES;
}

/* A pooled block of `size` bytes aligned to `alignment` (<= a page), or NULL; *dirty as obtain() says, counted
 * from the returned pointer. */
static void *pool_alloc(size_t size, size_t alignment, size_t *dirty) {
    size_t header = alignment > HEADER ? alignment : HEADER;
    if (size > SIZE_MAX - header - page_size) return NULL;
    size_t length = (size + header + page_size - 1) & ~(page_size - 1);
    pthread_mutex_lock(&pool_lock);
    size_t dirty_from_base = 0;
    size_t counted = expected_written(length);
    uintptr_t base = obtain(length, counted, &dirty_from_base);
    *dirty = dirty_from_base > header ? dirty_from_base - header : 0;
    void *user = NULL;
    if (base != 0) {
        if (table_insert(base + header, base, length, counted) == 0) {
            user = (void *)(base + header);
            blocks_served++;
            live_bytes += counted;
            if (live_bytes + kept_bytes > high_water) high_water = live_bytes + kept_bytes;
        } else {
            munmap((void *)base, length);
        }
    }
    pthread_mutex_unlock(&pool_lock);
    return user;
}

/* How many bytes of the mapping at `base` are resident (mincore); `length` when the kernel cannot say. */
static size_t resident_bytes(uintptr_t base, size_t length) {
    unsigned char pages_in[4096];
    size_t pages = length / page_size, resident = 0;
    for (size_t first = 0; first < pages; first += sizeof pages_in) {
        size_t count = pages - first < sizeof pages_in ? pages - first : sizeof pages_in;
        if (mincore((void *)(base + first * page_size), count * page_size, pages_in) != 0) return length;
        for (size_t i = 0; i < count; i++) resident += pages_in[i] & 1;
    }
    return resident * page_size;
}

/* Return a pooled block to the pool; 0 when `ptr` is not one. *usable receives its usable size.
 *
 * A large block freed with pages it never wrote (scratch booked for more than was used: oneDNN's GEMM weight
 * gradients on AVX2 book one per thread it might run) is kept counted as what it wrote (its other pages are not
 * resident), for a request of its own length only, and the high-water mark loses what it was counted as and did
 * not write: that mark bounds what is kept, so counting the scratch's untouched pages let the pool keep that much
 * more resident than the compact heap's peak (1.2 MB on the digits CNN at width 1). Its length is remembered with
 * what it wrote: the next block of that length counts as that much, so that its allocation does not evict kept
 * blocks for pages it will not write. */
static int pool_free(void *ptr, size_t *usable) {
    uintptr_t user = (uintptr_t)ptr;
    if (!in_range(user)) return 0;
    pthread_mutex_lock(&pool_lock);
    Entry *entry = table_find(user);
    int found = entry != NULL;
    if (found) {
        uintptr_t base = entry->base;
        size_t length = entry->length, counted = entry->counted;
        entry->user = 1;
        table_live--;
        live_bytes -= counted;
        if (usable != NULL) *usable = length - (user - base);
        size_t written = length >= SPARSE_CHECK_BYTES ? resident_bytes(base, length) : length;
        if (length >= SPARSE_CHECK_BYTES) learn_written(length, written);
        if (length - written > page_size) {
            /* The mark counted this block as `counted`: what it did not write comes off. Kept, it counts as what it
             * wrote, for the next block of its length. */
            size_t excess = counted > written ? counted - written : 0, floor = live_bytes + kept_bytes;
            high_water = high_water > floor + excess ? high_water - excess : floor;
            size_t resident = written < page_size ? page_size : written;
            if (kept_push(base, length, resident) != 0) {
                munmap((void *)base, length);
            } else if (live_bytes + kept_bytes > high_water) {
                high_water = live_bytes + kept_bytes; /* it did have that much resident */
            }
        } else if (kept_push(base, length, length) != 0) {
            munmap((void *)base, length);
        }
    }
    pthread_mutex_unlock(&pool_lock);
    return found;
}

/* A pooled block resized where it lies (its tail unmapped, or the mapping grown with mremap, pages kept), as
 * the compact heap's mremap does: never two copies resident. NULL when it cannot be (the caller copies). */
static void *pool_resize(void *ptr, size_t size) {
    uintptr_t user = (uintptr_t)ptr;
    void *result = NULL;
    pthread_mutex_lock(&pool_lock);
    Entry *entry = table_find(user);
    if (entry != NULL) {
        size_t header = user - entry->base;
        uintptr_t base = entry->base;
        size_t length = entry->length;
        if (size <= SIZE_MAX - header - page_size) {
            size_t wanted = (size + header + page_size - 1) & ~(page_size - 1);
            if (wanted <= length) {
                if (wanted < length && munmap((void *)(base + wanted), length - wanted) == 0) {
                    entry->length = wanted;
                    live_bytes -= entry->counted;
                    entry->counted = wanted; /* a resized block counts as all it maps */
                    live_bytes += wanted;
                }
                result = ptr;
            } else if (table_reserve() == 0) { /* (so that the re-insertion below cannot fail) */
                make_room(wanted - entry->counted);
                void *moved = mremap((void *)base, length, wanted, MREMAP_MAYMOVE);
                if (moved != MAP_FAILED) {
                    maps_made++;
                    bytes_mapped += wanted - length;
                    live_bytes += wanted - entry->counted; /* a resized block counts as all it maps */
                    if (live_bytes + kept_bytes > high_water) high_water = live_bytes + kept_bytes;
                    note_range((uintptr_t)moved, wanted);
                    entry->user = 1; /* re-inserted under its new address */
                    table_live--;
                    table_insert((uintptr_t)moved + header, (uintptr_t)moved, wanted, wanted);
                    result = (void *)((uintptr_t)moved + header);
                }
            }
        }
    }
    pthread_mutex_unlock(&pool_lock);
    return result;
}

static size_t pooled_size(void *ptr) {
    uintptr_t user = (uintptr_t)ptr;
    if (!in_range(user)) return 0;
    pthread_mutex_lock(&pool_lock);
    Entry *entry = table_find(user);
    size_t usable = entry != NULL ? entry->length - (user - entry->base) : 0;
    pthread_mutex_unlock(&pool_lock);
    return usable;
}

static int wants_pool(size_t size, size_t alignment) {
    return enabled && size >= threshold && alignment <= page_size;
}

/* ---- the interface the training child calls (ctypes) ---- */

int fedfit_pool_enable(size_t min_size) {
    long page = sysconf(_SC_PAGESIZE);
    pthread_mutex_lock(&pool_lock);
    page_size = page > 0 ? (size_t)page : 4096;
    threshold = min_size < 1 ? 1 : min_size;
    enabled = 1;
    pthread_mutex_unlock(&pool_lock);
    return 1;
}

/* Unmap every kept block and start a new high-water mark at the live blocks. */
void fedfit_pool_release(void) {
    pthread_mutex_lock(&pool_lock);
    while (kept_count > 0) {
        Kept block = kept_take(kept_count - 1);
        munmap((void *)block.base, block.length);
    }
    high_water = live_bytes;
    pthread_mutex_unlock(&pool_lock);
}

/* live, kept and high-water bytes, mappings made (or grown) and the bytes they mapped, and the blocks handed out,
 * since enabling. */
void fedfit_pool_stats(uint64_t out[6]) {
    pthread_mutex_lock(&pool_lock);
    out[0] = live_bytes;
    out[1] = kept_bytes;
    out[2] = high_water;
    out[3] = maps_made;
    out[4] = bytes_mapped;
    out[5] = blocks_served;
    pthread_mutex_unlock(&pool_lock);
}

/* ---- malloc's interface ---- */

void *malloc(size_t size) {
    if (wants_pool(size, HEADER)) {
        size_t dirty;
        void *p = pool_alloc(size, HEADER, &dirty);
        if (p != NULL) return p;
    }
    return __libc_malloc(size);
}

void free(void *ptr) {
    if (ptr == NULL) return;
    int saved = errno; /* free leaves errno alone (glibc 2.33 and later promise it) */
    if (!pool_free(ptr, NULL)) __libc_free(ptr);
    errno = saved;
}

void *calloc(size_t count, size_t size) {
    size_t total;
    if (__builtin_mul_overflow(count, size, &total)) {
        errno = ENOMEM;
        return NULL;
    }
    if (wants_pool(total, HEADER)) {
        size_t dirty;
        void *p = pool_alloc(total, HEADER, &dirty);
        if (p != NULL) {
            memset(p, 0, dirty < total ? dirty : total); /* only reused pages; fresh ones are zero untouched */
            return p;
        }
    }
    return __libc_calloc(count, size);
}

void *realloc(void *ptr, size_t size) {
    size_t usable = ptr != NULL ? pooled_size(ptr) : 0;
    if (usable == 0) {
        if (ptr == NULL) return malloc(size);
        return __libc_realloc(ptr, size); /* glibc's blocks stay glibc's */
    }
    if (size == 0) {
        free(ptr);
        return NULL;
    }
    void *resized = pool_resize(ptr, size);
    if (resized != NULL) return resized;
    void *moved = malloc(size);
    if (moved == NULL) return NULL;
    memcpy(moved, ptr, size < usable ? size : usable);
    free(ptr);
    return moved;
}

void *reallocarray(void *ptr, size_t count, size_t size) {
    size_t total;
    if (__builtin_mul_overflow(count, size, &total)) {
        errno = ENOMEM;
        return NULL;
    }
    return realloc(ptr, total);
}

static void *aligned(size_t alignment, size_t size) {
    if (wants_pool(size, alignment)) {
        size_t dirty;
        void *p = pool_alloc(size, alignment, &dirty);
        if (p != NULL) return p;
    }
    return __libc_memalign(alignment, size);
}

int posix_memalign(void **out, size_t alignment, size_t size) {
    if (alignment < sizeof(void *) || (alignment & (alignment - 1)) != 0) return EINVAL;
    void *p = aligned(alignment, size);
    if (p == NULL) return ENOMEM;
    *out = p;
    return 0;
}

void *aligned_alloc(size_t alignment, size_t size) {
    if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
        errno = EINVAL;
        return NULL;
    }
    return aligned(alignment, size);
}

void *memalign(size_t alignment, size_t size) {
    if (alignment == 0 || (alignment & (alignment - 1)) != 0) return __libc_memalign(alignment, size); /* rounds */
    return aligned(alignment, size);
}

void *valloc(size_t size) { return __libc_valloc(size); }

void *pvalloc(size_t size) { return __libc_pvalloc(size); }

static size_t (*glibc_usable_size)(void *);

static void lock_before_fork(void) { pthread_mutex_lock(&pool_lock); }
static void unlock_after_fork(void) { pthread_mutex_unlock(&pool_lock); }

__attribute__((constructor)) static void set_up(void) {
    /* (glibc's own: the pool is never preloaded beside another allocator, edge_agent.page_pool) */
    glibc_usable_size = (size_t (*)(void *))dlsym(RTLD_NEXT, "malloc_usable_size");
    /* A fork while another thread holds the lock would leave the child's copy locked for good. */
    pthread_atfork(lock_before_fork, unlock_after_fork, unlock_after_fork);
}

size_t malloc_usable_size(void *ptr) {
    if (ptr == NULL) return 0;
    size_t usable = pooled_size(ptr);
    if (usable != 0) return usable;
    return glibc_usable_size != NULL ? glibc_usable_size(ptr) : 0;
}
