// kvplug.hpp - header-only C++17 wrapper of libkvplug (include/kvplug.h).
//
// No link-time dependency: the library is loaded at run time with dlopen
// (link with -ldl on glibc older than 2.34) and never closed, since it
// contains a Go runtime that cannot be unloaded.
//
//   kvplug::load("/opt/kvplug/libkvplug.so");   // optional; else on first use
//   kvplug::Manager m(/*num_blocks=*/1024, /*block_size=*/16);
//   m.add(7, 100);
//   std::vector<int64_t> ids{7};
//   m.grow(ids, 1);
//   auto d = m.describe(ids);                   // d.block_table, d.seq_lens, d.slot_mapping
//
// Errors are exceptions: every failed call throws kvplug::Error, a
// std::runtime_error whose what() is the library's message and whose
// status() is the kvp_status. A failed call changes nothing, so an
// OUT_OF_BLOCKS from grow() can be caught, handled (preempt) and retried.
// A library that cannot be loaded is a kvplug::LibraryError, an Error too.
// Exceptions were chosen over an expected<T> type because C++17 has none,
// and the errors that a scheduler must handle (OUT_OF_BLOCKS) are rare
// compared with the calls that succeed.
//
// Loading: kvplug::load(path) loads the library explicitly; otherwise the
// first call loads $KVPLUG_LIBRARY, or "libkvplug.so" through the dynamic
// linker's search path. When that fails (no such file, not libkvplug, another
// ABI major version) the call throws kvplug::LibraryError, and a later call
// tries again. Each part of the API resolves its functions the first time it
// is used (see detail::table<T>()), so a library that lacks a newer part
// still serves the others: a function missing from it throws
// Error(KVP_ERR_UNSUPPORTED).
//
// Thread-safety: the same as the C API's. Loading is thread-safe.
#ifndef KVPLUG_HPP
#define KVPLUG_HPP

#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvplug.h"

namespace kvplug {

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

// A failed kvplug call. what() is the library's message (kvp_last_error()).
class Error : public std::runtime_error {
 public:
  Error(kvp_status status, const std::string &message)
      : std::runtime_error(message), status_(status) {}
  kvp_status status() const noexcept { return status_; }

 private:
  kvp_status status_;
};

// The library could not be loaded: not found, not a kvplug library, or of
// another ABI major version. what() says which path was tried and why.
//
// A type of its own, derived from Error so that `catch (const kvplug::Error&)`
// still catches it, rather than a status code of the wrapper's own: kvp_status
// is the C header's enum, whose next values belong to the header (a code
// chosen here could later mean something else), and converting an integer
// outside its enumerators' range to it is undefined behaviour in C++. Its
// status() is KVP_ERR_NOT_FOUND, the code that says "what was asked for is not
// there", never KVP_ERR_UNSUPPORTED, which tells a loaded library that lacks
// a feature (a function newer than it, kernels not built). To tell it apart
// from a missing key, catch LibraryError before Error.
class LibraryError : public Error {
 public:
  explicit LibraryError(const std::string &message) : Error(KVP_ERR_NOT_FOUND, message) {}
};

// ---------------------------------------------------------------------------
// span: a pointer and a size, built from a vector, a std::array, a C array
// or a (pointer, size) pair, so each method needs one overload.
// ---------------------------------------------------------------------------
template <class T>
class span {
 public:
  constexpr span() noexcept = default;
  constexpr span(T *data, std::size_t size) noexcept : data_(data), size_(size) {}
  template <std::size_t N>
  constexpr span(T (&a)[N]) noexcept : data_(a), size_(N) {}  // NOLINT(google-explicit-constructor)
  template <class U, std::size_t N,
            class = std::enable_if_t<std::is_convertible<U (*)[], T (*)[]>::value>>
  constexpr span(std::array<U, N> &a) noexcept : data_(a.data()), size_(N) {}  // NOLINT
  template <class U, std::size_t N,
            class = std::enable_if_t<std::is_convertible<const U (*)[], T (*)[]>::value>>
  constexpr span(const std::array<U, N> &a) noexcept : data_(a.data()), size_(N) {}  // NOLINT
  template <class U, class A, class = std::enable_if_t<std::is_convertible<U (*)[], T (*)[]>::value>>
  span(std::vector<U, A> &v) noexcept : data_(v.data()), size_(v.size()) {}  // NOLINT
  template <class U, class A,
            class = std::enable_if_t<std::is_convertible<const U (*)[], T (*)[]>::value>>
  span(const std::vector<U, A> &v) noexcept : data_(v.data()), size_(v.size()) {}  // NOLINT

  constexpr T *data() const noexcept { return data_; }
  constexpr std::size_t size() const noexcept { return size_; }
  constexpr bool empty() const noexcept { return size_ == 0; }
  constexpr T &operator[](std::size_t i) const noexcept { return data_[i]; }
  constexpr T *begin() const noexcept { return data_; }
  constexpr T *end() const noexcept { return data_ + size_; }

 private:
  T *data_ = nullptr;
  std::size_t size_ = 0;
};

namespace detail {

// ---------------------------------------------------------------------------
// Loader
// ---------------------------------------------------------------------------

// The loaded library. Never closed.
class Library {
 public:
  explicit Library(void *handle, std::string path) : handle_(handle), path_(std::move(path)) {}

  const std::string &path() const noexcept { return path_; }

  // The symbol `name` as a pointer of type F (a function pointer type,
  // normally decltype(&::kvp_x), so the C header fixes the signature).
  // Throws Error(KVP_ERR_UNSUPPORTED) when the library lacks it.
  template <class F>
  F sym(const char *name) const {
    static_assert(std::is_pointer<F>::value, "sym<F>: F must be a function pointer type");
    dlerror();
    void *p = dlsym(handle_, name);
    if (p == nullptr) {
      throw Error(KVP_ERR_UNSUPPORTED, std::string("kvplug: ") + path_ + " has no function " + name +
                                           " (a library older than this header?)");
    }
    return reinterpret_cast<F>(p);
  }

 private:
  void *handle_;
  std::string path_;
};

struct LoaderState {
  std::mutex mu;
  const Library *lib = nullptr;  // leaked on purpose, like the library itself
};

inline LoaderState &loader_state() {
  static LoaderState s;
  return s;
}

inline const Library &open_library(LoaderState &s, const char *path) {
  std::string p;
  if (path != nullptr && *path != '\0') {
    p = path;
  } else if (const char *env = std::getenv("KVPLUG_LIBRARY"); env != nullptr && *env != '\0') {
    p = env;
  } else {
    p = "libkvplug.so";
  }
  void *h = dlopen(p.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) {
    const char *why = dlerror();
    throw LibraryError("kvplug: cannot load " + p + ": " + (why ? why : "unknown dlopen error") +
                       " (set KVPLUG_LIBRARY or call kvplug::load(path))");
  }
  // The handle stays open whatever follows: dlclose of a Go runtime is never safe.
  dlerror();
  auto version = reinterpret_cast<decltype(&::kvp_version)>(dlsym(h, "kvp_version"));
  if (version == nullptr) throw LibraryError("kvplug: " + p + " is not libkvplug (it has no kvp_version)");
  if (version() / 10000 != KVP_VERSION_MAJOR) {
    throw LibraryError("kvplug: " + p + " has ABI version " + std::to_string(version() / 10000) +
                       ".x; this header is " + std::to_string(KVP_VERSION_MAJOR) + ".x");
  }
  auto *lib = new Library(h, p);
  s.lib = lib;
  return *lib;
}

// The library, loaded on first use.
inline const Library &library() {
  LoaderState &s = loader_state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.lib == nullptr) open_library(s, nullptr);
  return *s.lib;
}

// table<T>() is the function table T of one part of the API, resolved on
// first use. T has default-initialised function pointer members and a
// `void load(const Library &)` that fills them with KVPLUG_LOAD.
template <class T>
const T &table() {
  static const T t = [] {
    T x{};
    x.load(library());
    return x;
  }();
  return t;
}

// Declares a member named after a C function, typed by the header.
#define KVPLUG_FN(name) decltype(&::name) name = nullptr
// Resolves that member from the library `lib`.
#define KVPLUG_LOAD(lib, name) (name = (lib).template sym<decltype(&::name)>(#name))

// The library's common functions: version, errors, logging.
struct CommonApi {
  KVPLUG_FN(kvp_version);
  KVPLUG_FN(kvp_version_string);
  KVPLUG_FN(kvp_last_error);
  KVPLUG_FN(kvp_status_string);
  KVPLUG_FN(kvp_set_logger);
  KVPLUG_FN(kvp_set_log_level);
  void load(const Library &lib) {
    KVPLUG_LOAD(lib, kvp_version);
    KVPLUG_LOAD(lib, kvp_version_string);
    KVPLUG_LOAD(lib, kvp_last_error);
    KVPLUG_LOAD(lib, kvp_status_string);
    KVPLUG_LOAD(lib, kvp_set_logger);
    KVPLUG_LOAD(lib, kvp_set_log_level);
  }
};

inline const CommonApi &common() { return table<CommonApi>(); }

// Throws Error for a non-OK status, with the calling thread's message.
inline void check(kvp_status st) {
  if (st != KVP_OK) throw Error(st, common().kvp_last_error());
}

// The data of an input array, never NULL: an empty container's data() may
// be NULL, and the library should report its count (0), not a NULL pointer.
template <class T>
const T *in(span<const T> s) noexcept {
  static const T none{};
  return s.data() != nullptr ? s.data() : &none;
}

// n as an int32_t count; INVALID_ARGUMENT when it does not fit.
inline int32_t count32(std::size_t n, const char *what) {
  if (n > static_cast<std::size_t>(std::numeric_limits<int32_t>::max())) {
    throw Error(KVP_ERR_INVALID_ARGUMENT, std::string("kvplug: ") + what + " has " + std::to_string(n) +
                                              " elements; at most 2^31-1");
  }
  return static_cast<int32_t>(n);
}

}  // namespace detail

// Loads the library from path (or $KVPLUG_LIBRARY, or "libkvplug.so" when
// path is NULL) unless it is loaded already. Returns the path it was loaded
// from. Loading a second, different path throws: one Go runtime per process.
inline const std::string &load(const char *path = nullptr) {
  detail::LoaderState &s = detail::loader_state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.lib != nullptr) {
    if (path != nullptr && *path != '\0' && s.lib->path() != path) {
      throw Error(KVP_ERR_INVALID_ARGUMENT, "kvplug: already loaded from " + s.lib->path() +
                                                "; cannot load " + path + " too (one copy per process)");
    }
    return s.lib->path();
  }
  return detail::open_library(s, path).path();
}

// The loaded library's version: KVP_VERSION_NUMBER encoding, and "M.m.p".
inline uint32_t version() { return detail::common().kvp_version(); }
inline std::string version_string() { return detail::common().kvp_version_string(); }

namespace detail {
// Whether the library is loaded, without loading it.
inline bool loaded() {
  LoaderState &s = loader_state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.lib != nullptr;
}
}  // namespace detail

// The name of a status ("KVP_ERR_OUT_OF_BLOCKS"), or "KVP_ERR_UNKNOWN_STATUS"
// as kvp_status_string() says it. Never throws and needs no library for the
// codes of this header: it is what a handler of a kvplug::Error calls, also
// when the error is that the library could not be loaded.
inline const char *status_string(kvp_status st) noexcept {
  switch (st) {
    case KVP_OK: return "KVP_OK";
    case KVP_ERR_INVALID_ARGUMENT: return "KVP_ERR_INVALID_ARGUMENT";
    case KVP_ERR_NULL_POINTER: return "KVP_ERR_NULL_POINTER";
    case KVP_ERR_STRUCT_SIZE: return "KVP_ERR_STRUCT_SIZE";
    case KVP_ERR_INVALID_HANDLE: return "KVP_ERR_INVALID_HANDLE";
    case KVP_ERR_UNKNOWN_SEQUENCE: return "KVP_ERR_UNKNOWN_SEQUENCE";
    case KVP_ERR_DUPLICATE_SEQUENCE: return "KVP_ERR_DUPLICATE_SEQUENCE";
    case KVP_ERR_OUT_OF_BLOCKS: return "KVP_ERR_OUT_OF_BLOCKS";
    case KVP_ERR_BUFFER_TOO_SMALL: return "KVP_ERR_BUFFER_TOO_SMALL";
    case KVP_ERR_NO_DEVICE: return "KVP_ERR_NO_DEVICE";
    case KVP_ERR_CUDA: return "KVP_ERR_CUDA";
    case KVP_ERR_UNSUPPORTED: return "KVP_ERR_UNSUPPORTED";
    case KVP_ERR_OUT_OF_MEMORY: return "KVP_ERR_OUT_OF_MEMORY";
    case KVP_ERR_NOT_FOUND: return "KVP_ERR_NOT_FOUND";
    case KVP_ERR_INTERNAL: return "KVP_ERR_INTERNAL";
    case KVP_ERR_IN_USE: return "KVP_ERR_IN_USE";
    default: break;  // a code newer than this list: a loaded library may know it
  }
  try {
    if (detail::loaded()) return detail::common().kvp_status_string(st);
  } catch (...) {  // the library lacks the function, or a lock failed: no name then
  }
  return "KVP_ERR_UNKNOWN_STATUS";
}

// Routes the library's log lines to fn (NULL silences them) at level and above.
inline void set_logger(kvp_log_fn fn, void *user, int level = KVP_LOG_INFO) {
  detail::check(detail::common().kvp_set_logger(fn, user, level));
}
inline void set_log_level(int level) { detail::check(detail::common().kvp_set_log_level(level)); }

// ---------------------------------------------------------------------------
// Paged KV manager
// ---------------------------------------------------------------------------

namespace detail {
struct ManagerApi {
  KVPLUG_FN(kvp_manager_create);
  KVPLUG_FN(kvp_manager_destroy);
  KVPLUG_FN(kvp_manager_add);
  KVPLUG_FN(kvp_manager_grow);
  KVPLUG_FN(kvp_manager_fork);
  KVPLUG_FN(kvp_manager_remove);
  KVPLUG_FN(kvp_manager_mark_computed);
  KVPLUG_FN(kvp_manager_describe);
  KVPLUG_FN(kvp_manager_stats_get);
  KVPLUG_FN(kvp_manager_check);
  KVPLUG_FN(kvp_manager_describe_groups);
  KVPLUG_FN(kvp_manager_group_blocks);
  KVPLUG_FN(kvp_manager_take_copies);
  void load(const Library &lib) {
    KVPLUG_LOAD(lib, kvp_manager_create);
    KVPLUG_LOAD(lib, kvp_manager_destroy);
    KVPLUG_LOAD(lib, kvp_manager_add);
    KVPLUG_LOAD(lib, kvp_manager_grow);
    KVPLUG_LOAD(lib, kvp_manager_fork);
    KVPLUG_LOAD(lib, kvp_manager_remove);
    KVPLUG_LOAD(lib, kvp_manager_mark_computed);
    KVPLUG_LOAD(lib, kvp_manager_describe);
    KVPLUG_LOAD(lib, kvp_manager_stats_get);
    KVPLUG_LOAD(lib, kvp_manager_check);
    KVPLUG_LOAD(lib, kvp_manager_describe_groups);
    KVPLUG_LOAD(lib, kvp_manager_group_blocks);
    KVPLUG_LOAD(lib, kvp_manager_take_copies);
  }
};
inline const ManagerApi &manager_api() { return table<ManagerApi>(); }
}  // namespace detail

// A describe() result, in batch order.
struct Description {
  int32_t max_blocks = 0;              // row width of block_table
  std::vector<int32_t> block_table;    // [n][max_blocks], rows padded with -1
  std::vector<int32_t> seq_lens;       // [n]
  std::vector<int32_t> slot_mapping;   // slots of the batch's new tokens
};

// A kvp_manager: a pool of KV blocks and the block tables of the live
// sequences. Move-only; destroyed with the object. Safe to call from several
// threads (the library serialises calls on one manager), except for
// destruction and move-assignment.
class Manager {
 public:
  explicit Manager(int32_t num_blocks, int32_t block_size = 16) {
    kvp_manager_config cfg = KVP_MANAGER_CONFIG_INIT;
    cfg.num_blocks = num_blocks;
    cfg.block_size = block_size;
    create(cfg);
  }
  explicit Manager(const kvp_manager_config &cfg) { create(cfg); }

  // Takes ownership of a handle from kvp_manager_create.
  static Manager adopt(kvp_manager *h) noexcept { return Manager(h); }

  Manager(const Manager &) = delete;
  Manager &operator=(const Manager &) = delete;
  Manager(Manager &&o) noexcept : h_(std::exchange(o.h_, nullptr)), block_size_(o.block_size_) {}
  Manager &operator=(Manager &&o) noexcept {
    if (this != &o) {
      reset();
      h_ = std::exchange(o.h_, nullptr);
      block_size_ = o.block_size_;
    }
    return *this;
  }
  ~Manager() { reset(); }

  kvp_manager *get() const noexcept { return h_; }
  explicit operator bool() const noexcept { return h_ != nullptr; }
  // Gives up ownership; the caller destroys the handle.
  kvp_manager *release() noexcept { return std::exchange(h_, nullptr); }
  // Destroys the manager now (later calls throw INVALID_HANDLE).
  void reset() noexcept {
    if (h_ != nullptr) detail::manager_api().kvp_manager_destroy(std::exchange(h_, nullptr));
  }
  int32_t block_size() const noexcept { return block_size_; }

  // Admits seq_id with a prompt of prompt_len tokens.
  void add(int64_t seq_id, int32_t prompt_len) {
    detail::check(api().kvp_manager_add(h_, seq_id, prompt_len));
  }

  // Grows seq_ids[i] by num_tokens[i] tokens, all or none.
  void grow(span<const int64_t> seq_ids, span<const int32_t> num_tokens) {
    if (seq_ids.size() != num_tokens.size()) {
      throw Error(KVP_ERR_INVALID_ARGUMENT, "kvplug: grow: " + std::to_string(num_tokens.size()) +
                                                " token counts for " + std::to_string(seq_ids.size()) +
                                                " sequences");
    }
    detail::check(api().kvp_manager_grow(h_, detail::in(seq_ids), detail::in(num_tokens),
                                         detail::count32(seq_ids.size(), "grow: seq_ids")));
  }
  // Grows every sequence of the batch by the same number of tokens.
  void grow(span<const int64_t> seq_ids, int32_t num_tokens) {
    thread_local std::vector<int32_t> counts;
    counts.assign(seq_ids.size(), num_tokens);
    grow(seq_ids, span<const int32_t>(counts));
  }

  // Forks parent into children; returns the block copies the engine must
  // perform (per child: one when the parent's last block is partial; with
  // layer groups, one per attention group then, and one per recurrent
  // group).
  std::vector<kvp_block_copy> fork(int64_t parent, span<const int64_t> children) {
    std::vector<kvp_block_copy> copies(children.size() * static_cast<std::size_t>(num_groups()));
    copies.resize(fork(parent, children, span<kvp_block_copy>(copies)));
    return copies;
  }
  // Into a caller buffer; returns the number of copies written.
  int32_t fork(int64_t parent, span<const int64_t> children, span<kvp_block_copy> copies) {
    int32_t n = 0;
    detail::check(api().kvp_manager_fork(h_, parent, detail::in(children), detail::count32(children.size(), "fork: children"),
                                         copies.data(), detail::count32(copies.size(), "fork: copies"), &n));
    return n;
  }

  void remove(span<const int64_t> seq_ids) {
    detail::check(api().kvp_manager_remove(h_, detail::in(seq_ids), detail::count32(seq_ids.size(), "remove: seq_ids")));
  }
  void remove(int64_t seq_id) { remove(span<const int64_t>(&seq_id, 1)); }

  // The step's forward pass is launched: the K/V of every new token
  // described so far counts as computed, so removing a finished sequence
  // keeps its blocks cached. Call once per step, before removing finished
  // sequences (kvplug.h, "Computed K/V"); a no-op without the prefix cache.
  void mark_computed() { detail::check(api().kvp_manager_mark_computed(h_)); }

  // Describes the batch into caller buffers (any may be empty to skip it;
  // block_table holds seq_ids.size() rows of max_blocks). Returns the
  // number of slots. Checks the buffers' sizes before the call.
  int32_t describe_into(span<const int64_t> seq_ids, span<int32_t> block_table, int32_t max_blocks,
                        span<int32_t> seq_lens, span<int32_t> slot_mapping) {
    const std::size_t n = seq_ids.size();
    int32_t *table = nullptr;
    if (!block_table.empty()) {
      if (max_blocks < 1 || block_table.size() / static_cast<std::size_t>(max_blocks) < n) {
        throw Error(KVP_ERR_BUFFER_TOO_SMALL, "kvplug: describe: block_table holds " +
                                                  std::to_string(block_table.size()) + " entries; " +
                                                  std::to_string(n) + " x " + std::to_string(max_blocks) +
                                                  " needed");
      }
      table = block_table.data();
    }
    int32_t *lens = nullptr;
    if (!seq_lens.empty()) {
      if (seq_lens.size() < n) {
        throw Error(KVP_ERR_BUFFER_TOO_SMALL, "kvplug: describe: seq_lens holds " + std::to_string(seq_lens.size()) +
                                                  " entries for " + std::to_string(n) + " sequences");
      }
      lens = seq_lens.data();
    }
    // An empty slot_mapping with a non-NULL data() asks for slots with no
    // room for any (BUFFER_TOO_SMALL unless the batch has none).
    int32_t num = 0;
    detail::check(api().kvp_manager_describe(h_, detail::in(seq_ids), detail::count32(n, "describe: seq_ids"), table,
                                             max_blocks, lens, slot_mapping.data(),
                                             detail::count32(slot_mapping.size(), "describe: slot_mapping"), &num));
    return num;
  }

  // Describes the batch into new vectors; max_blocks 0 sizes the table to
  // the widest row the batch needs.
  Description describe(span<const int64_t> seq_ids, int32_t max_blocks = 0) {
    Description d;
    const int32_t n = detail::count32(seq_ids.size(), "describe: seq_ids");
    d.seq_lens.resize(seq_ids.size());
    int32_t num = 0;
    detail::check(api().kvp_manager_describe(h_, detail::in(seq_ids), n, nullptr, 0, d.seq_lens.data(), nullptr, 0, &num));
    if (max_blocks == 0) {
      int64_t longest = 0;
      for (int32_t len : d.seq_lens) longest = len > longest ? len : longest;
      max_blocks = static_cast<int32_t>((longest + block_size_ - 1) / block_size_);
      if (max_blocks < 1) max_blocks = 1;
    }
    d.max_blocks = max_blocks;
    d.block_table.resize(seq_ids.size() * static_cast<std::size_t>(max_blocks));
    d.slot_mapping.resize(static_cast<std::size_t>(num));
    int32_t dummy = 0;
    int32_t *slots = d.slot_mapping.empty() ? &dummy : d.slot_mapping.data();
    detail::check(api().kvp_manager_describe(h_, detail::in(seq_ids), n, d.block_table.data(), max_blocks,
                                             d.seq_lens.data(), slots, num, &num));
    d.slot_mapping.resize(static_cast<std::size_t>(num));
    return d;
  }

  // The manager's layer groups (1 without groups; see "Layer groups" in kvplug.h).
  int32_t num_groups() const {
    int32_t n = 0;
    const kvp_status st = api().kvp_manager_group_blocks(h_, nullptr, 0, &n);
    if (st != KVP_ERR_BUFFER_TOO_SMALL) detail::check(st);
    return n;
  }

  // The queued block copies, oldest first (kvp_manager_take_copies): a recurrent
  // group's checkpoints and the states of prefix hits. Perform them in order, every
  // layer slot of src into dst, on the next forward pass's stream before it.
  std::vector<kvp_block_copy> take_copies() {
    std::vector<kvp_block_copy> out;
    kvp_block_copy buf[256];
    for (;;) {
      int32_t n = 0, left = 0;
      detail::check(api().kvp_manager_take_copies(h_, buf, 256, &n, &left));
      out.insert(out.end(), buf, buf + n);
      if (left == 0) return out;
    }
  }

  // The blocks each layer group holds now (a block forked sequences share counts once).
  std::vector<int32_t> group_blocks() const {
    std::vector<int32_t> out(static_cast<std::size_t>(num_groups()));
    int32_t n = 0;
    detail::check(api().kvp_manager_group_blocks(h_, out.data(), detail::count32(out.size(), "group_blocks"), &n));
    out.resize(static_cast<std::size_t>(n));
    return out;
  }

  // Every layer group's description in one call (kvp_manager_describe_groups):
  // entry g is group g's, entry 0 what describe() returns. A sliding-window
  // group's rows hold -1 where blocks were dropped; a recurrent group's row is
  // its state block and it has no slots (its slot_mapping is all -1). max_blocks
  // 0 sizes the tables to the widest row the batch needs.
  std::vector<Description> describe_groups(span<const int64_t> seq_ids, int32_t max_blocks = 0) {
    const Description first = describe(seq_ids, max_blocks);  // sizes the batch
    const int32_t groups = num_groups();
    const int32_t n = detail::count32(seq_ids.size(), "describe_groups: seq_ids");
    std::vector<Description> out(static_cast<std::size_t>(groups), first);
    std::vector<int32_t *> tables, slots;
    int32_t dummy = 0;
    for (Description &d : out) {
      std::fill(d.slot_mapping.begin(), d.slot_mapping.end(), -1);
      tables.push_back(d.block_table.data());
      slots.push_back(d.slot_mapping.empty() ? &dummy : d.slot_mapping.data());
    }
    int32_t num = 0;
    detail::check(api().kvp_manager_describe_groups(h_, detail::in(seq_ids), n, groups, tables.data(), first.max_blocks,
                                                    nullptr, slots.data(),
                                                    detail::count32(first.slot_mapping.size(), "describe_groups"), &num));
    return out;
  }

  kvp_manager_stats stats() const {
    kvp_manager_stats s = KVP_MANAGER_STATS_INIT;
    detail::check(api().kvp_manager_stats_get(h_, &s));
    return s;
  }

  // Verifies the library's invariants; throws KVP_ERR_INTERNAL naming the first broken one.
  void check() const { detail::check(api().kvp_manager_check(h_)); }

 private:
  explicit Manager(kvp_manager *h) noexcept : h_(h) {
    if (h_ != nullptr) {
      kvp_manager_stats s = KVP_MANAGER_STATS_INIT;
      if (api().kvp_manager_stats_get(h_, &s) == KVP_OK) block_size_ = s.block_size;
    }
  }
  static const detail::ManagerApi &api() { return detail::manager_api(); }
  void create(const kvp_manager_config &cfg) {
    detail::check(api().kvp_manager_create(&cfg, &h_));
    // The library's block size: cfg.block_size 0 asks for the default.
    kvp_manager_stats s = KVP_MANAGER_STATS_INIT;
    block_size_ = api().kvp_manager_stats_get(h_, &s) == KVP_OK ? s.block_size : (cfg.block_size ? cfg.block_size : 16);
  }

  kvp_manager *h_ = nullptr;
  int32_t block_size_ = 16;
};

// Each section below belongs to one part of the library. A part declares
// its function table (a struct with KVPLUG_FN members and a load() using
// KVPLUG_LOAD, resolved lazily by detail::table<T>()) and its wrappers.

// ==== section: prefix cache (begin) ====

namespace detail {
struct PrefixApi {
  KVPLUG_FN(kvp_manager_admit);
  KVPLUG_FN(kvp_manager_grow_tokens);
  KVPLUG_FN(kvp_manager_match);
  KVPLUG_FN(kvp_manager_pin);
  KVPLUG_FN(kvp_manager_unpin);
  KVPLUG_FN(kvp_manager_set_priority);
  KVPLUG_FN(kvp_manager_prefix_stats);
  KVPLUG_FN(kvp_manager_prefix_stats_reset);
  KVPLUG_FN(kvp_manager_clear_prefix_cache);
  KVPLUG_FN(kvp_manager_drain_events);
  KVPLUG_FN(kvp_manager_next_event_size);
  KVPLUG_FN(kvp_manager_add_mm_items);
  void load(const Library &lib) {
    KVPLUG_LOAD(lib, kvp_manager_admit);
    KVPLUG_LOAD(lib, kvp_manager_grow_tokens);
    KVPLUG_LOAD(lib, kvp_manager_match);
    KVPLUG_LOAD(lib, kvp_manager_pin);
    KVPLUG_LOAD(lib, kvp_manager_unpin);
    KVPLUG_LOAD(lib, kvp_manager_set_priority);
    KVPLUG_LOAD(lib, kvp_manager_prefix_stats);
    KVPLUG_LOAD(lib, kvp_manager_prefix_stats_reset);
    KVPLUG_LOAD(lib, kvp_manager_clear_prefix_cache);
    KVPLUG_LOAD(lib, kvp_manager_drain_events);
    KVPLUG_LOAD(lib, kvp_manager_next_event_size);
    KVPLUG_LOAD(lib, kvp_manager_add_mm_items);
  }
};
inline const PrefixApi &prefix_api() { return table<PrefixApi>(); }

// KV events of layer groups (since 0.6), a table of their own so that a
// library without them still serves the rest of the prefix cache.
struct GroupEventsApi {
  KVPLUG_FN(kvp_manager_drain_group_events);
  KVPLUG_FN(kvp_manager_next_group_event_size);
  void load(const Library &lib) {
    KVPLUG_LOAD(lib, kvp_manager_drain_group_events);
    KVPLUG_LOAD(lib, kvp_manager_next_group_event_size);
  }
};
inline const GroupEventsApi &group_events_api() { return table<GroupEventsApi>(); }

// A prompt's block match beside its hit (since 0.7), a table of its own for
// the same reason.
struct MatchBlocksApi {
  KVPLUG_FN(kvp_manager_match_blocks);
  void load(const Library &lib) { KVPLUG_LOAD(lib, kvp_manager_match_blocks); }
};
inline const MatchBlocksApi &match_blocks_api() { return table<MatchBlocksApi>(); }

// The room an admission of a prompt has (since 0.7), a table of its own for
// the same reason.
struct MatchRoomApi {
  KVPLUG_FN(kvp_manager_match_room);
  void load(const Library &lib) { KVPLUG_LOAD(lib, kvp_manager_match_room); }
};
inline const MatchRoomApi &match_room_api() { return table<MatchRoomApi>(); }
}  // namespace detail

// A batch of prompts in the C API's flat form. Keys are views: the salt
// and multimodal arrays they point to must outlive the calls that use them.
struct Prompts {
  std::vector<int32_t> tokens;
  std::vector<int64_t> offsets{0};
  std::vector<kvp_prefix_keys> keys;  // empty, or one per prompt

  // Appends a prompt, with its keys (nullptr: none).
  Prompts &add(span<const int32_t> prompt, const kvp_prefix_keys *k = nullptr) {
    if (k != nullptr && keys.size() < size()) keys.resize(size(), kvp_prefix_keys KVP_PREFIX_KEYS_INIT);
    tokens.insert(tokens.end(), prompt.begin(), prompt.end());
    offsets.push_back(static_cast<int64_t>(tokens.size()));
    if (k != nullptr || !keys.empty()) keys.push_back(k != nullptr ? *k : kvp_prefix_keys KVP_PREFIX_KEYS_INIT);
    return *this;
  }
  std::size_t size() const noexcept { return offsets.size() - 1; }
  void clear() noexcept {
    tokens.clear();
    offsets.assign(1, 0);
    keys.clear();
  }
};

using BlockHash = std::array<uint8_t, 16>;

// A drained KV event with its variable parts.
struct KVEvent {
  int32_t kind = 0;  // KVP_KV_EVENT_...
  BlockHash hash{}, parent{};
  uint64_t adapter = 0;
  int32_t medium = KVP_MEDIUM_GPU;  // BLOCK_STORED, BLOCKS_REMOVED: KVP_MEDIUM_... (the host tier's: CPU)
  std::vector<int32_t> tokens;    // BLOCK_STORED
  std::vector<kvp_block_mm> mm;   // BLOCK_STORED
  std::vector<BlockHash> hashes;  // BLOCKS_REMOVED
};

// A drained KV event with its layer group (PrefixCache::drain_group_events;
// include/kvplug.h, "KV events of layer groups"): another group's block is
// named by its group-0 block's hash.
struct KVGroupEvent {
  KVEvent event;
  int32_t group = 0;  // BLOCK_STORED, BLOCKS_REMOVED: its blocks' layer group;
                      // 0 without groups and for ALL_CLEARED (every group's)
};

// The prefix cache of a Manager created with enable_prefix_cache: a view
// that does not own the manager, which must outlive it.
class PrefixCache {
 public:
  explicit PrefixCache(Manager &m) noexcept : m_(&m) {}

  // Admits seq_ids[i] with prompts' prompt i, in order, stopping at the
  // first that does not fit. Returns the matched tokens of those admitted
  // (fewer than the batch when the pool ran out: retry the rest later).
  std::vector<int32_t> admit(span<const int64_t> seq_ids, const Prompts &p) {
    check_batch("admit", seq_ids.size(), p);
    std::vector<int32_t> matched(seq_ids.size());
    int32_t n = 0;
    detail::check(api().kvp_manager_admit(m_->get(), detail::in(seq_ids), detail::count32(seq_ids.size(), "admit: seq_ids"),
                                          p.tokens.data(), p.offsets.data(), p.keys.empty() ? nullptr : p.keys.data(),
                                          matched.data(), &n));
    matched.resize(static_cast<std::size_t>(n));
    return matched;
  }

  // Grows seq_ids[i] by num_tokens[i] tokens, given in order in tokens.
  void grow_tokens(span<const int64_t> seq_ids, span<const int32_t> num_tokens, span<const int32_t> tokens) {
    if (seq_ids.size() != num_tokens.size()) {
      throw Error(KVP_ERR_INVALID_ARGUMENT, "kvplug: grow_tokens: " + std::to_string(num_tokens.size()) +
                                                " token counts for " + std::to_string(seq_ids.size()) + " sequences");
    }
    int64_t total = 0;
    for (int32_t c : num_tokens) total += c > 0 ? c : 0;
    if (static_cast<int64_t>(tokens.size()) != total) {
      throw Error(KVP_ERR_INVALID_ARGUMENT, "kvplug: grow_tokens: " + std::to_string(tokens.size()) +
                                                " tokens, the counts add up to " + std::to_string(total));
    }
    detail::check(api().kvp_manager_grow_tokens(m_->get(), detail::in(seq_ids), detail::in(num_tokens),
                                                detail::count32(seq_ids.size(), "grow_tokens: seq_ids"), tokens.data()));
  }

  // Appends multimodal items to a live sequence's keys, for tokens still to
  // come that its admission did not name (kvp_manager_add_mm_items).
  void add_mm_items(int64_t seq_id, span<const kvp_mm_item> items) {
    detail::check(api().kvp_manager_add_mm_items(m_->get(), seq_id, items.data(),
                                                 detail::count32(items.size(), "add_mm_items: items")));
  }

  // The longest cached prefix of each prompt, without admitting it.
  std::vector<kvp_prefix_match> match(const Prompts &p, bool want_partial = false) {
    check_batch("match", p.size(), p);
    std::vector<kvp_prefix_match> out(p.size());
    detail::check(api().kvp_manager_match(m_->get(), detail::count32(p.size(), "match: prompts"), p.tokens.data(),
                                          p.offsets.data(), p.keys.empty() ? nullptr : p.keys.data(),
                                          want_partial ? 1 : 0, out.data()));
    return out;
  }

  // Each prompt's hit and, beside it, the longest prefix of cached full
  // blocks (kvp_manager_match_blocks): with recurrent layer groups a hit
  // stops at its last checkpoint, and an engine that ends the prompt's step
  // at block_tokens (rounded down to a checkpoint boundary) leaves one there.
  std::vector<kvp_block_match> match_blocks(const Prompts &p) {
    check_batch("match_blocks", p.size(), p);
    std::vector<kvp_block_match> out(p.size());
    detail::check(detail::match_blocks_api().kvp_manager_match_blocks(
        m_->get(), detail::count32(p.size(), "match_blocks: prompts"), p.tokens.data(), p.offsets.data(),
        p.keys.empty() ? nullptr : p.keys.data(), out.data()));
    return out;
  }

  // Per prompt, the blocks an admission of it could allocate now beyond its
  // GPU hit (kvp_manager_match_room): free and evictable blocks, less the
  // hit's blocks nothing holds. Nothing is touched.
  std::vector<int32_t> match_room(const Prompts &p) {
    check_batch("match_room", p.size(), p);
    std::vector<int32_t> out(p.size());
    detail::check(detail::match_room_api().kvp_manager_match_room(
        m_->get(), detail::count32(p.size(), "match_room: prompts"), p.tokens.data(), p.offsets.data(),
        p.keys.empty() ? nullptr : p.keys.data(), out.data()));
    return out;
  }

  // Pins a prefix's cached full blocks; returns the pin id (blocks pinned
  // into *num_blocks when given).
  uint64_t pin(span<const int32_t> tokens, const kvp_prefix_keys *keys = nullptr, int32_t *num_blocks = nullptr) {
    uint64_t id = 0;
    detail::check(api().kvp_manager_pin(m_->get(), tokens.data(), detail::count32(tokens.size(), "pin: tokens"), keys,
                                        &id, num_blocks));
    return id;
  }
  void unpin(uint64_t pin_id) { detail::check(api().kvp_manager_unpin(m_->get(), pin_id)); }

  // Sets a prefix's eviction priority; returns the blocks set.
  int32_t set_priority(span<const int32_t> tokens, int32_t priority, const kvp_prefix_keys *keys = nullptr) {
    int32_t n = 0;
    detail::check(api().kvp_manager_set_priority(m_->get(), tokens.data(),
                                                 detail::count32(tokens.size(), "set_priority: tokens"), keys,
                                                 priority, &n));
    return n;
  }

  kvp_prefix_stats stats() const {
    kvp_prefix_stats s = KVP_PREFIX_STATS_INIT;
    detail::check(api().kvp_manager_prefix_stats(m_->get(), &s));
    return s;
  }
  void reset_stats() { detail::check(api().kvp_manager_prefix_stats_reset(m_->get())); }

  // Drops every unheld cached block and every pin; returns the blocks freed.
  int32_t clear() {
    int32_t n = 0;
    detail::check(api().kvp_manager_clear_prefix_cache(m_->get(), &n));
    return n;
  }

  // Drains up to max_events pending KV events, oldest first; empty when
  // none is pending. Buffers too small for the oldest event (a block with
  // many multimodal entries) grow to the size the library reports. With
  // layer groups these are group 0's events: the other groups' are passed
  // over and gone (drain_group_events returns them).
  std::vector<KVEvent> drain_events(int32_t max_events = 1024) {
    const auto &a = api();
    return drain<kvp_kv_event, KVEvent>("drain_events", max_events, a.kvp_manager_drain_events,
                                        a.kvp_manager_next_event_size);
  }

  // drain_events for every layer group's events, each with its group: a
  // router that mirrors every group's blocks predicts a hybrid model's hits
  // exactly. Without layer groups it returns drain_events' events, every
  // one of group 0. Use one of the two drains: the events either takes are
  // gone for the other.
  std::vector<KVGroupEvent> drain_group_events(int32_t max_events = 1024) {
    const auto &a = detail::group_events_api();
    return drain<kvp_kv_group_event, KVGroupEvent>("drain_group_events", max_events,
                                                   a.kvp_manager_drain_group_events,
                                                   a.kvp_manager_next_group_event_size);
  }

 private:
  static const detail::PrefixApi &api() { return detail::prefix_api(); }

  static const kvp_kv_event &raw(const kvp_kv_event &e) noexcept { return e; }
  static const kvp_kv_event &raw(const kvp_kv_group_event &e) noexcept { return e.event; }
  static KVEvent &body(KVEvent &o) noexcept { return o; }
  static KVEvent &body(KVGroupEvent &o) noexcept { return o.event; }

  // One drain (Raw: kvp_kv_event or kvp_kv_group_event), copied out of the
  // call's buffers into Out values that own their parts.
  template <class Raw, class Out, class DrainFn, class SizeFn>
  std::vector<Out> drain(const char *op, int32_t max_events, DrainFn drain_fn, SizeFn size_fn) {
    const int32_t bs = m_->block_size();
    const std::size_t cap = static_cast<std::size_t>(std::max(max_events, 1));
    std::vector<Raw> evs(cap);
    // Room for up to 256 stored blocks a call: the caller loops anyway.
    std::vector<int32_t> toks(std::min<std::size_t>(cap, 256) * static_cast<std::size_t>(bs));
    std::vector<kvp_block_mm> mm(256);
    std::vector<BlockHash> hashes(cap * 4);
    const std::string what_tok = std::string(op) + ": tokens", what_mm = std::string(op) + ": mm",
                      what_hash = std::string(op) + ": hashes";
    int32_t n = 0;
    kvp_status st = KVP_OK;
    // A retry is sized by the library's answer for the oldest event, so it
    // succeeds unless another thread changes the queue in between.
    for (int attempt = 0; attempt < 8; ++attempt) {
      st = drain_fn(m_->get(), evs.data(), max_events, toks.data(),
                    detail::count32(toks.size(), what_tok.c_str()), mm.data(),
                    detail::count32(mm.size(), what_mm.c_str()), hashes.data()->data(),
                    detail::count32(hashes.size(), what_hash.c_str()), &n);
      if (st != KVP_ERR_BUFFER_TOO_SMALL) break;
      int32_t need_tok = 0, need_mm = 0, need_hash = 0;
      detail::check(size_fn(m_->get(), &need_tok, &need_mm, &need_hash));
      toks.resize(std::max(toks.size(), static_cast<std::size_t>(need_tok)));
      mm.resize(std::max(mm.size(), static_cast<std::size_t>(need_mm)));
      hashes.resize(std::max(hashes.size(), static_cast<std::size_t>(need_hash)));
    }
    detail::check(st);
    std::vector<Out> out(static_cast<std::size_t>(n));
    for (int32_t i = 0; i < n; ++i) {
      const Raw &r = evs[static_cast<std::size_t>(i)];
      const kvp_kv_event &e = raw(r);
      KVEvent &o = body(out[static_cast<std::size_t>(i)]);
      o.kind = e.kind;
      std::copy(std::begin(e.hash), std::end(e.hash), o.hash.begin());
      std::copy(std::begin(e.parent), std::end(e.parent), o.parent.begin());
      o.adapter = e.adapter;
      o.medium = e.medium;
      if (e.kind == KVP_KV_EVENT_BLOCK_STORED) {
        o.tokens.assign(toks.begin() + e.tokens_offset, toks.begin() + e.tokens_offset + e.block_size);
        o.mm.assign(mm.begin() + e.mm_offset, mm.begin() + e.mm_offset + e.num_mm);
      } else if (e.kind == KVP_KV_EVENT_BLOCKS_REMOVED) {
        o.hashes.assign(hashes.begin() + e.hashes_offset, hashes.begin() + e.hashes_offset + e.num_hashes);
      }
      if constexpr (std::is_same<Raw, kvp_kv_group_event>::value) out[static_cast<std::size_t>(i)].group = r.group;
    }
    return out;
  }

  static void check_batch(const char *op, std::size_t n, const Prompts &p) {
    if (p.size() != n || (!p.keys.empty() && p.keys.size() != p.size())) {
      throw Error(KVP_ERR_INVALID_ARGUMENT, std::string("kvplug: ") + op + ": " + std::to_string(p.size()) +
                                                " prompts, " + std::to_string(p.keys.size()) + " keys for a batch of " +
                                                std::to_string(n));
    }
  }
  Manager *m_;
};

// ==== section: prefix cache (end) ====

// ==== section: host KV tier (begin) ====

namespace detail {
struct TierApi {
  KVPLUG_FN(kvp_manager_flush_copies);
  KVPLUG_FN(kvp_manager_complete_copies);
  KVPLUG_FN(kvp_manager_match_tiers);
  KVPLUG_FN(kvp_manager_tier_stats);
  KVPLUG_FN(kvp_manager_host_tier_memory);
  void load(const Library &lib) {
    KVPLUG_LOAD(lib, kvp_manager_flush_copies);
    KVPLUG_LOAD(lib, kvp_manager_complete_copies);
    KVPLUG_LOAD(lib, kvp_manager_match_tiers);
    KVPLUG_LOAD(lib, kvp_manager_tier_stats);
    KVPLUG_LOAD(lib, kvp_manager_host_tier_memory);
  }
};
inline const TierApi &tier_api() { return table<TierApi>(); }
}  // namespace detail

// One step's host tier copies (HostTier::flush_copies): demotions copy GPU
// block .block into host slot .slot, reloads host slot .slot into GPU block
// .block (before the step's attention). ticket 0: nothing to copy.
struct CopyBatch {
  uint64_t ticket = 0;
  std::vector<kvp_tier_copy> demote, reload;
};

// The host KV tier of a Manager created with host_tier_slots > 0 (see the
// header's "Host KV tier"): a view that does not own the manager, which
// must outlive it. The engine performs the copies. A shared tier below it
// (a Valkey or Redis server: the config's shared_tier_addr and
// shared_tier_namespace, whose strings need only outlive the Manager's
// constructor; the header's "Shared KV tier") works through the same
// calls: admit and match_tiers fetch its blocks into host slots, and
// stats() carries its shared_* counters.
class HostTier {
 public:
  explicit HostTier(Manager &m) noexcept : m_(&m) {}

  // Demotes and returns this step's copy batch; call complete_copies with
  // its ticket (when nonzero) once the copies have finished. Arrays the
  // library finds too small grow to the size it reports.
  CopyBatch flush_copies() {
    CopyBatch b;
    int32_t nd = 0, nr = 0;
    b.demote.resize(64);
    b.reload.resize(64);
    for (;;) {
      const kvp_status st = api().kvp_manager_flush_copies(
          m_->get(), b.demote.data(), static_cast<int32_t>(b.demote.size()), &nd, b.reload.data(),
          static_cast<int32_t>(b.reload.size()), &nr, &b.ticket);
      if (st != KVP_ERR_BUFFER_TOO_SMALL) {
        detail::check(st);
        break;
      }
      b.demote.resize(std::max<std::size_t>(b.demote.size(), static_cast<std::size_t>(nd)));
      b.reload.resize(std::max<std::size_t>(b.reload.size(), static_cast<std::size_t>(nr)));
    }
    b.demote.resize(static_cast<std::size_t>(nd));
    b.reload.resize(static_cast<std::size_t>(nr));
    return b;
  }

  // Reports batch ticket's copies finished (or failed).
  void complete_copies(uint64_t ticket, bool failed = false) {
    detail::check(api().kvp_manager_complete_copies(m_->get(), ticket, failed ? 1 : 0));
  }

  // Per prompt, the tokens matched in the GPU prefix cache and, beyond
  // them, in the host tier.
  std::vector<kvp_tier_match> match_tiers(const Prompts &p) {
    if (!p.keys.empty() && p.keys.size() != p.size()) {
      throw Error(KVP_ERR_INVALID_ARGUMENT, "kvplug: match_tiers: " + std::to_string(p.keys.size()) + " keys for " +
                                                std::to_string(p.size()) + " prompts");
    }
    std::vector<kvp_tier_match> out(p.size());
    detail::check(api().kvp_manager_match_tiers(m_->get(), detail::count32(p.size(), "match_tiers: prompts"),
                                                p.tokens.data(), p.offsets.data(),
                                                p.keys.empty() ? nullptr : p.keys.data(), out.data()));
    return out;
  }

  kvp_tier_stats stats() const {
    kvp_tier_stats s = KVP_TIER_STATS_INIT;
    detail::check(api().kvp_manager_tier_stats(m_->get(), &s));
    return s;
  }

  // Slot s's memory (slot_bytes() bytes), the library's, valid until the
  // manager is destroyed.
  uint8_t *slot(int32_t s) const {
    void *base = nullptr;
    int64_t bytes = 0;
    int32_t n = 0;
    detail::check(api().kvp_manager_host_tier_memory(m_->get(), &base, &bytes, &n));
    if (s < 0 || s >= n) {
      throw Error(KVP_ERR_INVALID_ARGUMENT, "kvplug: host slot " + std::to_string(s) + " of " + std::to_string(n));
    }
    return static_cast<uint8_t *>(base) + static_cast<int64_t>(s) * bytes;
  }
  int64_t slot_bytes() const {
    int64_t bytes = 0;
    detail::check(api().kvp_manager_host_tier_memory(m_->get(), nullptr, &bytes, nullptr));
    return bytes;
  }
  int32_t num_slots() const {
    int32_t n = 0;
    detail::check(api().kvp_manager_host_tier_memory(m_->get(), nullptr, nullptr, &n));
    return n;
  }

 private:
  static const detail::TierApi &api() { return detail::tier_api(); }
  Manager *m_;
};

// ==== section: host KV tier (end) ====

// ==== section: tier copy (begin) ====

namespace detail {
struct TierCopyApi {
  KVPLUG_FN(kvp_tier_copier_create);
  KVPLUG_FN(kvp_tier_copier_run);
  KVPLUG_FN(kvp_tier_copier_destroy);
  void load(const Library &lib) {
    KVPLUG_LOAD(lib, kvp_tier_copier_create);
    KVPLUG_LOAD(lib, kvp_tier_copier_run);
    KVPLUG_LOAD(lib, kvp_tier_copier_destroy);
  }
};
inline const TierCopyApi &tier_copy_api() { return table<TierCopyApi>(); }
}  // namespace detail

// What copies a tier copier's demotions (GPU block -> host slot), the
// values of kvp_kv_layers.flags: the tier copy kernel, as reloads, or the
// copy engines (KVP_TIER_COPY_STORE_COPY_ENGINE: a CUDA 12.8 or newer
// driver, and runs with demotions on a stream other than the legacy default
// stream). Python's store_engine="kernel" and "copy-engine".
enum class StoreEngine : int32_t {
  kernel = 0,
  copy_engine = KVP_TIER_COPY_STORE_COPY_ENGINE,
};

// Copies host tier batches between the engine's paged GPU caches and host
// slots, every layer's K and V of a batch in one launch (the header's
// "tier copy"). Owns its kvp_tier_copier; destroy it before the manager
// whose host memory it registered.
class TierCopier {
 public:
  // k and v: per layer, the device address of block 0 (v empty: K only).
  TierCopier(const std::vector<uint64_t> &k, const std::vector<uint64_t> &v, int32_t num_blocks, int64_t block_bytes,
             int64_t k_block_stride, int64_t v_block_stride, void *host, int64_t slot_bytes, int32_t num_slots,
             StoreEngine store_engine = StoreEngine::kernel) {
    kvp_kv_layers l = KVP_KV_LAYERS_INIT;
    l.num_layers = detail::count32(k.size(), "TierCopier: layers");
    l.num_blocks = num_blocks;
    l.k = k.data();
    l.v = v.empty() ? nullptr : v.data();
    if (!v.empty() && v.size() != k.size()) {
      throw Error(KVP_ERR_INVALID_ARGUMENT, "kvplug: TierCopier: " + std::to_string(v.size()) + " V layers for " +
                                                std::to_string(k.size()) + " K layers");
    }
    l.block_bytes = block_bytes;
    l.k_block_stride = k_block_stride;
    l.v_block_stride = v_block_stride;
    create(l, store_engine, host, slot_bytes, num_slots);
  }
  // Over a manager's host tier memory.
  TierCopier(const std::vector<uint64_t> &k, const std::vector<uint64_t> &v, int32_t num_blocks, int64_t block_bytes,
             int64_t k_block_stride, int64_t v_block_stride, const HostTier &tier,
             StoreEngine store_engine = StoreEngine::kernel)
      : TierCopier(k, v, num_blocks, block_bytes, k_block_stride, v_block_stride, tier.slot(0), tier.slot_bytes(),
                   tier.num_slots(), store_engine) {}

  // kv: per layer, its kvp_paged_kv (kvp_kv_layers.kv), the descriptor the
  // attention calls take (the table fields are not read; dtype and head_dim
  // must be set), read during the constructor only: every layer of one
  // shape, a block's tokens dense (token_stride = num_kv_heads * head_dim,
  // head_stride = head_dim), V in every layer or in none. An e4m3 cache's
  // scales come in the same descriptors, scale_kind, k_scale and v_scale
  // (Python's k_scales= and v_scales=). With KVP_KV_SCALE_TOKEN_HEAD each
  // block's scales move with the block, and slot_bytes must hold, per layer
  // and tensor (K, V), the block's e4m3 bytes and its block_size *
  // num_kv_heads * 4 bytes of scales; a KVP_KV_SCALE_TENSOR scale stays
  // with the engine.
  TierCopier(span<const kvp_paged_kv *const> kv, void *host, int64_t slot_bytes, int32_t num_slots,
             StoreEngine store_engine = StoreEngine::kernel) {
    kvp_kv_layers l = KVP_KV_LAYERS_INIT;
    l.num_layers = detail::count32(kv.size(), "TierCopier: layers");
    l.kv = kv.data();
    create(l, store_engine, host, slot_bytes, num_slots);
  }
  TierCopier(span<const kvp_paged_kv *const> kv, const HostTier &tier, StoreEngine store_engine = StoreEngine::kernel)
      : TierCopier(kv, tier.slot(0), tier.slot_bytes(), tier.num_slots(), store_engine) {}
  // The same with the descriptors in one array (one a layer).
  TierCopier(span<const kvp_paged_kv> kv, void *host, int64_t slot_bytes, int32_t num_slots,
             StoreEngine store_engine = StoreEngine::kernel)
      : TierCopier(span<const kvp_paged_kv *const>(addresses(kv)), host, slot_bytes, num_slots, store_engine) {}
  TierCopier(span<const kvp_paged_kv> kv, const HostTier &tier, StoreEngine store_engine = StoreEngine::kernel)
      : TierCopier(span<const kvp_paged_kv *const>(addresses(kv)), tier, store_engine) {}

  TierCopier(const TierCopier &) = delete;
  TierCopier &operator=(const TierCopier &) = delete;
  TierCopier(TierCopier &&o) noexcept : h_(std::exchange(o.h_, nullptr)) {}
  TierCopier &operator=(TierCopier &&o) noexcept {
    if (this != &o) {
      reset();
      h_ = std::exchange(o.h_, nullptr);
    }
    return *this;
  }
  ~TierCopier() { reset(); }
  void reset() noexcept {
    if (h_ != nullptr) api().kvp_tier_copier_destroy(std::exchange(h_, nullptr));
  }
  kvp_tier_copier *get() const noexcept { return h_; }

  // Enqueues the batch's demotions and reloads on stream (a cudaStream_t).
  void run(const CopyBatch &b, void *stream = nullptr) {
    detail::check(api().kvp_tier_copier_run(h_, b.demote.data(), detail::count32(b.demote.size(), "run: demote"),
                                            b.reload.data(), detail::count32(b.reload.size(), "run: reload"), stream));
  }

 private:
  static const detail::TierCopyApi &api() { return detail::tier_copy_api(); }
  void create(kvp_kv_layers &l, StoreEngine store_engine, void *host, int64_t slot_bytes, int32_t num_slots) {
    l.flags = static_cast<int32_t>(store_engine);
    detail::check(api().kvp_tier_copier_create(&l, host, slot_bytes, num_slots, &h_));
  }
  static std::vector<const kvp_paged_kv *> addresses(span<const kvp_paged_kv> kv) {
    std::vector<const kvp_paged_kv *> p;
    p.reserve(kv.size());
    for (const kvp_paged_kv &d : kv) p.push_back(&d);
    return p;
  }
  kvp_tier_copier *h_ = nullptr;
};

// ==== section: tier copy (end) ====

// ==== section: attention kernels (begin) ====

namespace detail {
struct AttnApi {
  KVPLUG_FN(kvp_cuda_available);
  KVPLUG_FN(kvp_attn_prepare);
  KVPLUG_FN(kvp_attn_workspace_size);
  KVPLUG_FN(kvp_attn_num_splits);
  KVPLUG_FN(kvp_kv_write);
  KVPLUG_FN(kvp_paged_decode);
  KVPLUG_FN(kvp_merge_states);
  KVPLUG_FN(kvp_prefill_workspace_size);
  KVPLUG_FN(kvp_prefill_plan);
  KVPLUG_FN(kvp_paged_prefill);
  void load(const Library &lib) {
    KVPLUG_LOAD(lib, kvp_cuda_available);
    KVPLUG_LOAD(lib, kvp_attn_prepare);
    KVPLUG_LOAD(lib, kvp_attn_workspace_size);
    KVPLUG_LOAD(lib, kvp_attn_num_splits);
    KVPLUG_LOAD(lib, kvp_kv_write);
    KVPLUG_LOAD(lib, kvp_paged_decode);
    KVPLUG_LOAD(lib, kvp_merge_states);
    KVPLUG_LOAD(lib, kvp_prefill_workspace_size);
    KVPLUG_LOAD(lib, kvp_prefill_plan);
    KVPLUG_LOAD(lib, kvp_paged_prefill);
  }
};
inline const AttnApi &attn_api() { return table<AttnApi>(); }
}  // namespace detail

// Attention kernels on the engine's device pointers (raw CUdeviceptr values
// as uint64_t) and CUstream (as uint64_t; 0 = legacy default stream). The
// args structs are the C header's: initialise with their _INIT macro, set
// the fields, and launch. Launches neither synchronise nor allocate.
//
//   kvp_paged_kv kv = KVP_PAGED_KV_INIT;            // one per layer, built once
//   kv.dtype = KVP_DTYPE_BF16; kv.k_cache = ...; kv.block_table = ...; ...
//   kvp_paged_decode_args a = KVP_PAGED_DECODE_ARGS_INIT;
//   a.head_dim = 128; a.batch = B; a.q = ...; a.kv = &kv;
//   kvplug::attn::paged_decode(a, reinterpret_cast<uint64_t>(stream));
namespace attn {

// True when a CUDA driver and a device are present.
inline bool cuda_available() {
  int32_t v = 0;
  detail::check(detail::attn_api().kvp_cuda_available(&v));
  return v != 0;
}

// Loads the kernels into the current context now (before graph capture).
inline void prepare() { detail::check(detail::attn_api().kvp_attn_prepare()); }

// Bytes of decode workspace for batches up to max_batch with up to
// max_splits splits (0 = the library's default ceiling).
inline uint64_t workspace_size(int32_t max_batch, int32_t num_q_heads, int32_t head_dim,
                               int32_t max_splits = 0) {
  uint64_t n = 0;
  detail::check(detail::attn_api().kvp_attn_workspace_size(max_batch, num_q_heads, head_dim, max_splits, &n));
  return n;
}

// The split count paged_decode chooses for this shape on the current device.
inline int32_t num_splits(kvp_dtype dtype, int32_t head_dim, int32_t batch, int32_t num_q_heads,
                          int32_t num_kv_heads, int32_t max_seq_len) {
  int32_t n = 0;
  detail::check(detail::attn_api().kvp_attn_num_splits(dtype, head_dim, batch, num_q_heads, num_kv_heads,
                                                       max_seq_len, &n));
  return n;
}

inline void kv_write(const kvp_kv_write_args &a, uint64_t stream = 0) {
  detail::check(detail::attn_api().kvp_kv_write(&a, stream));
}

inline void paged_decode(const kvp_paged_decode_args &a, uint64_t stream = 0) {
  detail::check(detail::attn_api().kvp_paged_decode(&a, stream));
}

inline void merge_states(const kvp_merge_states_args &a, uint64_t stream = 0) {
  detail::check(detail::attn_api().kvp_merge_states(&a, stream));
}

// Bytes of workspace prefill_plan needs for batches of up to max_batch
// sequences and max_tokens query tokens in all.
inline uint64_t prefill_workspace_size(int32_t max_batch, int32_t max_tokens, int32_t num_q_heads,
                                       int32_t num_kv_heads, int32_t head_dim) {
  uint64_t n = 0;
  detail::check(detail::attn_api().kvp_prefill_workspace_size(max_batch, max_tokens, num_q_heads, num_kv_heads,
                                                              head_dim, &n));
  return n;
}

// Plans a varlen batch once per step (kvp_prefill_plan_args: host and
// device copies of qo_indptr and kv_lens, the workspace); the returned plan
// is a plain struct to pass to paged_prefill for every layer of the step.
//
//   kvp_prefill_plan_args pa = KVP_PREFILL_PLAN_ARGS_INIT;
//   pa.dtype = KVP_DTYPE_BF16; pa.head_dim = 128; pa.num_q_heads = 32; ...
//   kvp_attn_plan plan = kvplug::attn::prefill_plan(pa, stream);
//   for (layer ...) { a.q = ...; kvplug::attn::paged_prefill(plan, a, stream); }
inline kvp_attn_plan prefill_plan(const kvp_prefill_plan_args &a, uint64_t stream = 0) {
  kvp_attn_plan plan = KVP_ATTN_PLAN_INIT;
  detail::check(detail::attn_api().kvp_prefill_plan(&a, &plan, stream));
  return plan;
}

inline void paged_prefill(const kvp_attn_plan &plan, const kvp_paged_prefill_args &a, uint64_t stream = 0) {
  detail::check(detail::attn_api().kvp_paged_prefill(&plan, &a, stream));
}

}  // namespace attn

// ==== section: attention kernels (end) ====

// ==== section: virtual-contiguous KV cache (begin) ====

namespace detail {
struct VCacheApi {
  KVPLUG_FN(kvp_vcache_create);
  KVPLUG_FN(kvp_vcache_destroy);
  KVPLUG_FN(kvp_vcache_layer_ptrs);
  KVPLUG_FN(kvp_vcache_strides);
  KVPLUG_FN(kvp_vcache_alloc_slot);
  KVPLUG_FN(kvp_vcache_free_slot);
  KVPLUG_FN(kvp_vcache_step);
  KVPLUG_FN(kvp_vcache_trim);
  KVPLUG_FN(kvp_vcache_stats_get);
  void load(const Library &lib) {
    KVPLUG_LOAD(lib, kvp_vcache_create);
    KVPLUG_LOAD(lib, kvp_vcache_destroy);
    KVPLUG_LOAD(lib, kvp_vcache_layer_ptrs);
    KVPLUG_LOAD(lib, kvp_vcache_strides);
    KVPLUG_LOAD(lib, kvp_vcache_alloc_slot);
    KVPLUG_LOAD(lib, kvp_vcache_free_slot);
    KVPLUG_LOAD(lib, kvp_vcache_step);
    KVPLUG_LOAD(lib, kvp_vcache_trim);
    KVPLUG_LOAD(lib, kvp_vcache_stats_get);
  }
};
inline const VCacheApi &vcache_api() { return table<VCacheApi>(); }
}  // namespace detail

// A kvp_vcache (vAttention): each layer's K and V is one dense virtual
// tensor [max_batch][max_context][num_kv_heads][head_dim] whose pages are
// mapped as slots grow, so unmodified kernels index it directly. The slot
// stride is padded to whole pages: use strides()[0], not
// max_context * num_kv_heads * head_dim.
//
//   kvp_vcache_config cfg = KVP_VCACHE_CONFIG_INIT;
//   cfg.num_layers = 32; cfg.num_kv_heads = 8; cfg.head_dim = 128;
//   cfg.max_batch = 64; cfg.max_context = 32768; cfg.budget_bytes = 40ll << 30;
//   kvplug::VCache vc(cfg);
//   int32_t s = vc.alloc_slot();
//   vc.step(slots, ctx_lens);               // before each step's kernels
//   auto [k0, v0] = vc.layer_ptrs(0);       // CUdeviceptr of layer 0's K and V
//
// Move-only; thread-safe like the C object, except destruction.
class VCache {
 public:
  explicit VCache(const kvp_vcache_config &cfg) { detail::check(api().kvp_vcache_create(&cfg, &h_)); }

  VCache(const VCache &) = delete;
  VCache &operator=(const VCache &) = delete;
  VCache(VCache &&o) noexcept : h_(std::exchange(o.h_, nullptr)) {}
  VCache &operator=(VCache &&o) noexcept {
    if (this != &o) {
      reset();
      h_ = std::exchange(o.h_, nullptr);
    }
    return *this;
  }
  ~VCache() { reset(); }

  kvp_vcache *get() const noexcept { return h_; }
  explicit operator bool() const noexcept { return h_ != nullptr; }
  // Unmaps and frees everything now; every pointer from the cache dies.
  void reset() noexcept {
    if (h_ != nullptr) detail::vcache_api().kvp_vcache_destroy(std::exchange(h_, nullptr));
  }

  // A free slot, preferring the freed slot that holds the most pages.
  int32_t alloc_slot() {
    int32_t s = -1;
    detail::check(api().kvp_vcache_alloc_slot(h_, &s));
    return s;
  }
  void free_slot(int32_t slot) { detail::check(api().kvp_vcache_free_slot(h_, slot)); }

  // Maps tokens [0, ctx_lens[i]) of slots[i] in every layer; throws
  // KVP_ERR_OUT_OF_MEMORY (nothing changed) when the budget cannot cover it.
  void step(span<const int32_t> slots, span<const int32_t> ctx_lens) {
    if (slots.size() != ctx_lens.size()) {
      throw Error(KVP_ERR_INVALID_ARGUMENT, "kvplug: step: " + std::to_string(ctx_lens.size()) +
                                                " context lengths for " + std::to_string(slots.size()) + " slots");
    }
    detail::check(api().kvp_vcache_step(h_, detail::in(slots), detail::in(ctx_lens),
                                        detail::count32(slots.size(), "step: slots")));
  }

  // Base addresses (CUdeviceptr for the CUDA backend) of layer's K and V.
  std::pair<uint64_t, uint64_t> layer_ptrs(int32_t layer) const {
    uint64_t k = 0, v = 0;
    detail::check(api().kvp_vcache_layer_ptrs(h_, layer, &k, &v));
    return {k, v};
  }

  // Strides of [slot, token, head, dim] in elements.
  std::array<int64_t, 4> strides() const {
    std::array<int64_t, 4> s{};
    detail::check(api().kvp_vcache_strides(h_, s.data()));
    return s;
  }

  // Gives freed slots' pages and idle pages back to the driver.
  void trim() { detail::check(api().kvp_vcache_trim(h_)); }

  kvp_vcache_stats stats() const {
    kvp_vcache_stats s = KVP_VCACHE_STATS_INIT;
    detail::check(api().kvp_vcache_stats_get(h_, &s));
    return s;
  }

 private:
  static const detail::VCacheApi &api() { return detail::vcache_api(); }
  kvp_vcache *h_ = nullptr;
};

// ==== section: virtual-contiguous KV cache (end) ====

// ==== section: shared-prefix attention (begin) ====

namespace detail {
struct CascadeApi {
  KVPLUG_FN(kvp_cascade_workspace_size);
  KVPLUG_FN(kvp_cascade_plan);
  KVPLUG_FN(kvp_cascade_update);
  KVPLUG_FN(kvp_paged_cascade);
  void load(const Library &lib) {
    KVPLUG_LOAD(lib, kvp_cascade_workspace_size);
    KVPLUG_LOAD(lib, kvp_cascade_plan);
    KVPLUG_LOAD(lib, kvp_cascade_update);
    KVPLUG_LOAD(lib, kvp_paged_cascade);
  }
};
inline const CascadeApi &cascade_api() { return table<CascadeApi>(); }
}  // namespace detail

namespace detail {
// Its own table, so that a library older than this function fails only the
// calls that need it.
struct CascadeManagerApi {
  KVPLUG_FN(kvp_manager_cascade_plan);
  void load(const Library &lib) { KVPLUG_LOAD(lib, kvp_manager_cascade_plan); }
};
inline const CascadeManagerApi &cascade_manager_api() { return table<CascadeManagerApi>(); }

// Its own table too (varlen queries came after the first release).
struct CascadePrefillApi {
  KVPLUG_FN(kvp_cascade_prefill_workspace_size);
  void load(const Library &lib) { KVPLUG_LOAD(lib, kvp_cascade_prefill_workspace_size); }
};
inline const CascadePrefillApi &cascade_prefill_api() { return table<CascadePrefillApi>(); }
}  // namespace detail

// Shared-prefix decode attention (see the header's section): plan from the
// host block table and lengths into the engine's two workspaces, run per
// layer, and check in O(batch) whether a step that only grew still fits.
//
//   auto sz = kvplug::cascade::workspace_size(max_batch, 32, 8, 128);  // allocate sz.device / sz.host (pinned)
//   kvp_cascade_plan_args pa = KVP_CASCADE_PLAN_ARGS_INIT;
//   pa.dtype = KVP_DTYPE_F16; ...; pa.max_batch = max_batch;
//   kvp_attn_plan plan = kvplug::cascade::plan(pa, stream);
//   for (layer ...) kvplug::cascade::paged_cascade(plan, layer_args, stream);
//   next step: if (!kvplug::cascade::update(plan, lens, batch)) plan = kvplug::cascade::plan(pa, stream);
//
// Varlen queries (prompts or chunks sharing a cached prefix, decode rows
// mixed): size the workspaces with workspace_size(max_batch, max_tokens, ...)
// and set pa.max_tokens, pa.qo_indptr_host and pa.qo_indptr; q and out of
// the layer args are [total_q, num_q_heads, head_dim].
namespace cascade {

struct WorkspaceSizes {
  uint64_t device = 0;
  uint64_t host = 0;
};

inline WorkspaceSizes workspace_size(int32_t max_batch, int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim) {
  WorkspaceSizes s;
  detail::check(detail::cascade_api().kvp_cascade_workspace_size(max_batch, num_q_heads, num_kv_heads, head_dim,
                                                                 &s.device, &s.host));
  return s;
}

// Workspaces for batches of up to max_batch sequences with max_tokens query
// rows in all (kvp_cascade_prefill_workspace_size).
inline WorkspaceSizes workspace_size(int32_t max_batch, int32_t max_tokens, int32_t num_q_heads, int32_t num_kv_heads,
                                     int32_t head_dim) {
  WorkspaceSizes s;
  detail::check(detail::cascade_prefill_api().kvp_cascade_prefill_workspace_size(
      max_batch, max_tokens, num_q_heads, num_kv_heads, head_dim, &s.device, &s.host));
  return s;
}

inline kvp_attn_plan plan(const kvp_cascade_plan_args &a, uint64_t stream = 0) {
  kvp_attn_plan p = KVP_ATTN_PLAN_INIT;
  detail::check(detail::cascade_api().kvp_cascade_plan(&a, &p, stream));
  return p;
}

// True when plan still covers these lengths; false: plan again.
inline bool update(const kvp_attn_plan &plan, const int32_t *seq_lens_host, int32_t batch) {
  int32_t fits = 0;
  detail::check(detail::cascade_api().kvp_cascade_update(&plan, seq_lens_host, batch, &fits));
  return fits == 1;
}

inline void paged_cascade(const kvp_attn_plan &plan, const kvp_paged_prefill_args &a, uint64_t stream = 0) {
  detail::check(detail::cascade_api().kvp_paged_cascade(&plan, &a, stream));
}

// Plans the batch seq_ids[n] of m from the manager's own block tables and
// lengths (kvp_manager_cascade_plan): a leaves block_table_host and
// seq_lens_host NULL and sets max_blocks_per_seq to the device table's
// width. With a.workspace 0 and a.host_workspace NULL the plan is the
// host-only summary (route, and the saved and total tokens per kv head in
// state[KVP_PLAN_STATE_SAVED_TOKENS] and [KVP_PLAN_STATE_TOTAL_TOKENS]),
// which needs no device and cannot be run.
//
//   kvp_cascade_plan_args pa = KVP_CASCADE_PLAN_ARGS_INIT;  // as for plan(), without the host arrays
//   pa.max_blocks_per_seq = table_width;
//   kvp_attn_plan plan = kvplug::cascade::plan(manager, ids, pa, stream);  // ids: the step's describe ids
inline kvp_attn_plan plan(const Manager &m, span<const int64_t> seq_ids, const kvp_cascade_plan_args &a,
                          uint64_t stream = 0) {
  kvp_attn_plan p = KVP_ATTN_PLAN_INIT;
  detail::check(detail::cascade_manager_api().kvp_manager_cascade_plan(
      m.get(), detail::in(seq_ids), detail::count32(seq_ids.size(), "cascade::plan: seq_ids"), &a, &p, stream));
  return p;
}

}  // namespace cascade

// ==== section: shared-prefix attention (end) ====

// ==== section: standalone host store (begin) ====

namespace detail {
struct HostStoreApi {
  KVPLUG_FN(kvp_host_store_create);
  KVPLUG_FN(kvp_host_store_destroy);
  KVPLUG_FN(kvp_host_store_state);
  KVPLUG_FN(kvp_host_store_lookup_prefix);
  KVPLUG_FN(kvp_host_store_reserve);
  KVPLUG_FN(kvp_host_store_complete);
  KVPLUG_FN(kvp_host_store_pin);
  KVPLUG_FN(kvp_host_store_unpin);
  KVPLUG_FN(kvp_host_store_touch);
  KVPLUG_FN(kvp_host_store_reset);
  KVPLUG_FN(kvp_host_store_stats_get);
  KVPLUG_FN(kvp_host_store_memory);
  KVPLUG_FN(kvp_host_store_write);
  KVPLUG_FN(kvp_host_store_read);
  void load(const Library &lib) {
    KVPLUG_LOAD(lib, kvp_host_store_create);
    KVPLUG_LOAD(lib, kvp_host_store_destroy);
    KVPLUG_LOAD(lib, kvp_host_store_state);
    KVPLUG_LOAD(lib, kvp_host_store_lookup_prefix);
    KVPLUG_LOAD(lib, kvp_host_store_reserve);
    KVPLUG_LOAD(lib, kvp_host_store_complete);
    KVPLUG_LOAD(lib, kvp_host_store_pin);
    KVPLUG_LOAD(lib, kvp_host_store_unpin);
    KVPLUG_LOAD(lib, kvp_host_store_touch);
    KVPLUG_LOAD(lib, kvp_host_store_reset);
    KVPLUG_LOAD(lib, kvp_host_store_stats_get);
    KVPLUG_LOAD(lib, kvp_host_store_memory);
    KVPLUG_LOAD(lib, kvp_host_store_write);
    KVPLUG_LOAD(lib, kvp_host_store_read);
  }
};
inline const HostStoreApi &host_store_api() { return table<HostStoreApi>(); }

// The data of an output vector, never NULL (an empty vector's data() may
// be): the library reports the count, not a NULL pointer.
template <class T>
T *out(std::vector<T> &v) noexcept {
  thread_local T none{};
  return v.empty() ? &none : v.data();
}

// Checks a scatter list of n items of segs segments each: ptrs and lens of
// n * segs entries. segs < 1 is left to the library to refuse.
inline void check_segments(const char *op, std::size_t n, int32_t segs, std::size_t ptrs, std::size_t lens) {
  if (ptrs != lens || (segs > 0 && ptrs != n * static_cast<std::size_t>(segs))) {
    throw Error(KVP_ERR_INVALID_ARGUMENT, std::string("kvplug: ") + op + ": " + std::to_string(ptrs) + " pointers and " +
                                              std::to_string(lens) + " lengths for " + std::to_string(n) + " x " +
                                              std::to_string(segs) + " segments");
  }
}
}  // namespace detail

// HostStore::reserve's result: slots[i] is key i's slot, -1 for a key held
// already or repeated; evicted the keys evicted to make room, in order.
struct HostStoreReservation {
  std::vector<int32_t> slots;
  std::vector<uint64_t> evicted;
};

// HostStore::state's result: states[i] is KVP_HOST_KEY_*, slots[i] its
// slot (-1 when absent).
struct HostStoreStates {
  std::vector<int32_t> states;
  std::vector<int32_t> slots;
};

// HostStore::pin's result: slots[i] is key i's pinned slot, -1 for a miss;
// pinned the number of pins taken (each needs one unpin).
struct HostStorePins {
  std::vector<int32_t> slots;
  int32_t pinned = 0;
};

// A standalone host store (kvp_host_store, the header's "standalone host
// store"): keyed host slots without a manager, for an engine that keeps its
// own GPU block manager and performs the copies itself. Move-only; owns the
// handle. Note the names: clear() is kvp_host_store_reset (drops every
// block); reset() destroys the store, as for the other handles.
class HostStore {
 public:
  // num_slots slots of slot_bytes bytes (0: bookkeeping only, no memory).
  explicit HostStore(int32_t num_slots, int64_t slot_bytes = 0) {
    kvp_host_store_config cfg = KVP_HOST_STORE_CONFIG_INIT;
    cfg.num_slots = num_slots;
    cfg.slot_bytes = slot_bytes;
    detail::check(api().kvp_host_store_create(&cfg, &h_));
  }
  explicit HostStore(const kvp_host_store_config &cfg) { detail::check(api().kvp_host_store_create(&cfg, &h_)); }

  // Takes ownership of a handle from kvp_host_store_create.
  static HostStore adopt(kvp_host_store *h) noexcept { return HostStore(h); }

  HostStore(const HostStore &) = delete;
  HostStore &operator=(const HostStore &) = delete;
  HostStore(HostStore &&o) noexcept : h_(std::exchange(o.h_, nullptr)) {}
  HostStore &operator=(HostStore &&o) noexcept {
    if (this != &o) {
      reset();
      h_ = std::exchange(o.h_, nullptr);
    }
    return *this;
  }
  ~HostStore() { reset(); }

  kvp_host_store *get() const noexcept { return h_; }
  explicit operator bool() const noexcept { return h_ != nullptr; }
  // Gives up ownership; the caller destroys the handle.
  kvp_host_store *release() noexcept { return std::exchange(h_, nullptr); }
  // Destroys the store and its memory now (later calls throw INVALID_HANDLE).
  void reset() noexcept {
    if (h_ != nullptr) api().kvp_host_store_destroy(std::exchange(h_, nullptr));
  }

  // Each key's state and slot; touches and counts nothing.
  HostStoreStates state(span<const uint64_t> keys) const {
    HostStoreStates r;
    r.states.resize(keys.size());
    r.slots.resize(keys.size());
    detail::check(api().kvp_host_store_state(h_, detail::count32(keys.size(), "state: keys"), detail::in(keys),
                                             detail::out(r.states), detail::out(r.slots)));
    return r;
  }

  // The number of keys, from the first, that are resident; marks them
  // recently used. Pins nothing.
  int32_t lookup_prefix(span<const uint64_t> keys) {
    int32_t matched = 0;
    detail::check(api().kvp_host_store_lookup_prefix(h_, detail::count32(keys.size(), "lookup_prefix: keys"),
                                                     detail::in(keys), &matched));
    return matched;
  }

  // Reserves a slot for each key the store does not hold, all or none:
  // throws OUT_OF_BLOCKS (nothing changed) when the batch does not fit.
  HostStoreReservation reserve(span<const uint64_t> keys) {
    HostStoreReservation r;
    detail::check(reserve_into(keys, r));
    return r;
  }
  // As reserve, but a batch that does not fit returns false (r untouched).
  bool try_reserve(span<const uint64_t> keys, HostStoreReservation &r) {
    HostStoreReservation tmp;
    const kvp_status st = reserve_into(keys, tmp);
    if (st == KVP_ERR_OUT_OF_BLOCKS) return false;
    detail::check(st);
    r = std::move(tmp);
    return true;
  }

  // Commits (failed false) or gives back the pending keys of keys; returns
  // how many were pending (the others count in stats().stale).
  int32_t complete(span<const uint64_t> keys, bool failed = false) {
    int32_t n = 0;
    detail::check(api().kvp_host_store_complete(h_, detail::count32(keys.size(), "complete: keys"), detail::in(keys),
                                                failed ? 1 : 0, &n));
    return n;
  }

  // Pins the slot of each resident key for a copy out of it.
  HostStorePins pin(span<const uint64_t> keys) {
    HostStorePins r;
    r.slots.resize(keys.size());
    detail::check(api().kvp_host_store_pin(h_, detail::count32(keys.size(), "pin: keys"), detail::in(keys),
                                           detail::out(r.slots), &r.pinned));
    return r;
  }

  // Drops one pin of each pinned key; returns how many it unpinned.
  int32_t unpin(span<const uint64_t> keys) {
    int32_t n = 0;
    detail::check(
        api().kvp_host_store_unpin(h_, detail::count32(keys.size(), "unpin: keys"), detail::in(keys), &n));
    return n;
  }

  // Marks the resident keys of keys recently used, the first most recently.
  void touch(span<const uint64_t> keys) {
    detail::check(api().kvp_host_store_touch(h_, detail::count32(keys.size(), "touch: keys"), detail::in(keys)));
  }

  // kvp_host_store_reset: drops every block, pending and pinned ones
  // included (no copy may still use them); returns the slots it freed.
  int32_t clear() {
    int32_t n = 0;
    detail::check(api().kvp_host_store_reset(h_, &n));
    return n;
  }

  kvp_host_store_stats stats() const {
    kvp_host_store_stats s = KVP_HOST_STORE_STATS_INIT;
    detail::check(api().kvp_host_store_stats_get(h_, &s));
    return s;
  }

  // The store's memory (kvp_host_store_memory): base is NULL without
  // memory; slot s is at base + s * slot_bytes, valid until destroyed.
  void *base() const {
    void *b = nullptr;
    detail::check(api().kvp_host_store_memory(h_, &b, nullptr, nullptr));
    return b;
  }
  int64_t slot_bytes() const {
    int64_t bytes = 0;
    detail::check(api().kvp_host_store_memory(h_, nullptr, &bytes, nullptr));
    return bytes;
  }
  int32_t num_slots() const {
    int32_t n = 0;
    detail::check(api().kvp_host_store_memory(h_, nullptr, nullptr, &n));
    return n;
  }
  // Slot s's memory; INVALID_ARGUMENT out of range, UNSUPPORTED without memory.
  uint8_t *slot(int32_t s) const {
    void *b = nullptr;
    int64_t bytes = 0;
    int32_t n = 0;
    detail::check(api().kvp_host_store_memory(h_, &b, &bytes, &n));
    if (b == nullptr) throw Error(KVP_ERR_UNSUPPORTED, "kvplug: the host store has no memory (slot_bytes 0)");
    if (s < 0 || s >= n) {
      throw Error(KVP_ERR_INVALID_ARGUMENT, "kvplug: host store slot " + std::to_string(s) + " of " + std::to_string(n));
    }
    return static_cast<uint8_t *>(b) + static_cast<int64_t>(s) * bytes;
  }

  // Copies into pending slots: slot slots[i] receives the concatenation of
  // segments [i * segs, (i + 1) * segs) of ptrs (lengths in lens), which
  // must total slot_bytes().
  void write(span<const int32_t> slots, span<const void *const> ptrs, span<const int64_t> lens, int32_t segs = 1) {
    detail::check_segments("host store write", slots.size(), segs, ptrs.size(), lens.size());
    detail::check(api().kvp_host_store_write(h_, detail::count32(slots.size(), "write: slots"), detail::in(slots), segs,
                                             detail::in(ptrs), detail::in(lens)));
  }
  void write(int32_t slot, const void *data, int64_t len) {
    write(span<const int32_t>(&slot, 1), span<const void *const>(&data, 1), span<const int64_t>(&len, 1));
  }

  // Copies out of resident slots (hold a pin on each), as write lays them out.
  void read(span<const int32_t> slots, span<void *const> ptrs, span<const int64_t> lens, int32_t segs = 1) const {
    detail::check_segments("host store read", slots.size(), segs, ptrs.size(), lens.size());
    detail::check(api().kvp_host_store_read(h_, detail::count32(slots.size(), "read: slots"), detail::in(slots), segs,
                                            detail::in(ptrs), detail::in(lens)));
  }
  void read(int32_t slot, void *data, int64_t len) const {
    read(span<const int32_t>(&slot, 1), span<void *const>(&data, 1), span<const int64_t>(&len, 1));
  }

 private:
  explicit HostStore(kvp_host_store *h) noexcept : h_(h) {}
  static const detail::HostStoreApi &api() { return detail::host_store_api(); }
  kvp_status reserve_into(span<const uint64_t> keys, HostStoreReservation &r) {
    const int32_t n = detail::count32(keys.size(), "reserve: keys");
    r.slots.resize(keys.size());
    r.evicted.resize(keys.size());
    int32_t ne = 0;
    const kvp_status st = api().kvp_host_store_reserve(h_, n, detail::in(keys), detail::out(r.slots),
                                                       detail::out(r.evicted), &ne);
    r.evicted.resize(st == KVP_OK ? static_cast<std::size_t>(ne) : 0);
    return st;
  }

  kvp_host_store *h_ = nullptr;
};

// ==== section: standalone host store (end) ====

// ==== section: standalone shared store (begin) ====

namespace detail {
struct SharedStoreApi {
  KVPLUG_FN(kvp_shared_store_create);
  KVPLUG_FN(kvp_shared_store_destroy);
  KVPLUG_FN(kvp_shared_store_exists);
  KVPLUG_FN(kvp_shared_store_put);
  KVPLUG_FN(kvp_shared_store_get);
  KVPLUG_FN(kvp_shared_store_stats_get);
  void load(const Library &lib) {
    KVPLUG_LOAD(lib, kvp_shared_store_create);
    KVPLUG_LOAD(lib, kvp_shared_store_destroy);
    KVPLUG_LOAD(lib, kvp_shared_store_exists);
    KVPLUG_LOAD(lib, kvp_shared_store_put);
    KVPLUG_LOAD(lib, kvp_shared_store_get);
    KVPLUG_LOAD(lib, kvp_shared_store_stats_get);
  }
};
inline const SharedStoreApi &shared_store_api() { return table<SharedStoreApi>(); }
}  // namespace detail

// A shared store's key: 16 bytes (a 128-bit hash of the block's identity).
using SharedKey = std::array<uint8_t, 16>;
static_assert(sizeof(SharedKey) == 16, "SharedKey must be 16 bytes with no padding");

// A standalone client of a Valkey or Redis server shared by instances
// (kvp_shared_store, the header's "standalone shared store"). The server's
// faults never throw: a server that is down or slow makes misses and
// skipped stores, counted in stats(); only bad arguments throw. Move-only;
// owns the handle. create does not connect. AUTH, TLS and the MAC are the
// config's fields after reserved (the header's "Shared KV tier",
// Security): construct from a kvp_shared_store_config to set them.
class SharedStore {
 public:
  SharedStore(const std::string &address, const std::string &key_space, uint64_t fingerprint = 0,
              int64_t block_bytes = 0) {
    kvp_shared_store_config cfg = KVP_SHARED_STORE_CONFIG_INIT;
    cfg.address = address.c_str();
    cfg.key_space = key_space.c_str();
    cfg.fingerprint = fingerprint;
    cfg.block_bytes = block_bytes;
    detail::check(api().kvp_shared_store_create(&cfg, &h_));
  }
  // The config's strings need only outlive the constructor.
  explicit SharedStore(const kvp_shared_store_config &cfg) { detail::check(api().kvp_shared_store_create(&cfg, &h_)); }

  // Takes ownership of a handle from kvp_shared_store_create.
  static SharedStore adopt(kvp_shared_store *h) noexcept { return SharedStore(h); }

  SharedStore(const SharedStore &) = delete;
  SharedStore &operator=(const SharedStore &) = delete;
  SharedStore(SharedStore &&o) noexcept : h_(std::exchange(o.h_, nullptr)) {}
  SharedStore &operator=(SharedStore &&o) noexcept {
    if (this != &o) {
      reset();
      h_ = std::exchange(o.h_, nullptr);
    }
    return *this;
  }
  ~SharedStore() { reset(); }

  kvp_shared_store *get() const noexcept { return h_; }
  explicit operator bool() const noexcept { return h_ != nullptr; }
  kvp_shared_store *release() noexcept { return std::exchange(h_, nullptr); }
  // Destroys the client and closes its connection now.
  void reset() noexcept {
    if (h_ != nullptr) api().kvp_shared_store_destroy(std::exchange(h_, nullptr));
  }

  // found[i] is 1 when the server holds key i, else 0; one round trip.
  std::vector<int32_t> exists(span<const SharedKey> keys) {
    std::vector<int32_t> found(keys.size());
    detail::check(api().kvp_shared_store_exists(h_, detail::count32(keys.size(), "exists: keys"), bytes(keys),
                                                detail::out(found)));
    return found;
  }

  // Stores keys.size() blocks in one round trip: key i's payload is the
  // concatenation of segments [i * segs, (i + 1) * segs) of ptrs (lengths
  // in lens). Returns how many the server accepted.
  int32_t put(span<const SharedKey> keys, span<const void *const> ptrs, span<const int64_t> lens, int32_t segs = 1) {
    detail::check_segments("shared store put", keys.size(), segs, ptrs.size(), lens.size());
    int32_t stored = 0;
    detail::check(api().kvp_shared_store_put(h_, detail::count32(keys.size(), "put: keys"), bytes(keys), segs,
                                             detail::in(ptrs), detail::in(lens), &stored));
    return stored;
  }

  // Fetches keys.size() blocks into the caller's segments (as put lays
  // them out): found[i] is 1 when key i's payload was found, checked, of
  // exactly its segments' length, and copied; 0 leaves them untouched.
  std::vector<int32_t> get(span<const SharedKey> keys, span<void *const> ptrs, span<const int64_t> lens,
                           int32_t segs = 1) {
    detail::check_segments("shared store get", keys.size(), segs, ptrs.size(), lens.size());
    std::vector<int32_t> found(keys.size());
    detail::check(api().kvp_shared_store_get(h_, detail::count32(keys.size(), "get: keys"), bytes(keys), segs,
                                             detail::in(ptrs), detail::in(lens), detail::out(found)));
    return found;
  }

  kvp_shared_store_stats stats() const {
    kvp_shared_store_stats s = KVP_SHARED_STORE_STATS_INIT;
    detail::check(api().kvp_shared_store_stats_get(h_, &s));
    return s;
  }

 private:
  explicit SharedStore(kvp_shared_store *h) noexcept : h_(h) {}
  static const detail::SharedStoreApi &api() { return detail::shared_store_api(); }
  static const uint8_t *bytes(span<const SharedKey> keys) noexcept {
    return reinterpret_cast<const uint8_t *>(detail::in(keys));
  }

  kvp_shared_store *h_ = nullptr;
};

// ==== section: standalone shared store (end) ====

}  // namespace kvplug

#endif  // KVPLUG_HPP
