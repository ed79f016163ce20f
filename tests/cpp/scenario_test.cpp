// The ABI scenarios of testdata/scenarios (their README has the format),
// run through include/kvplug.h: the same calls, statuses and message
// fragments as the Go (capi) and Python runners, and a failed call changes
// nothing observable. KVPLUG_SCENARIOS is the folder, set by CMake.
#include <gtest/gtest.h>

#include <dirent.h>

#include <algorithm>
#include <cctype>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvplug.h"

#ifndef KVPLUG_SCENARIOS
#error "KVPLUG_SCENARIOS must name the testdata/scenarios folder"
#endif

namespace {

struct Value {
  std::string raw;
  bool null = false;
  bool is_list = false;
  std::vector<std::vector<int64_t>> lists;
  const std::vector<int64_t> &list() const {
    static const std::vector<int64_t> empty;
    return lists.empty() ? empty : lists[0];
  }
};

Value parse_value(const std::string &s) {
  Value v;
  v.raw = s;
  v.null = s == "NULL";
  if (s.empty() || s[0] != '[') return v;
  v.is_list = true;
  std::stringstream parts(s);
  std::string part;
  while (std::getline(parts, part, '/')) {
    if (part.size() < 2 || part.front() != '[' || part.back() != ']') throw std::runtime_error("bad list " + part);
    std::vector<int64_t> l;
    std::stringstream items(part.substr(1, part.size() - 2));
    std::string item;
    while (std::getline(items, item, ',')) {
      if (item.empty()) continue;
      size_t dots = item.find("..");
      if (dots != std::string::npos) {
        int64_t lo = std::stoll(item.substr(0, dots)), hi = std::stoll(item.substr(dots + 2));
        if (hi < lo) throw std::runtime_error("bad range " + item);
        for (int64_t x = lo; x <= hi; x++) l.push_back(x);
      } else {
        l.push_back(std::stoll(item));
      }
    }
    v.lists.push_back(l);
  }
  return v;
}

struct Stmt {
  std::string where, call, want, frag;
  std::map<std::string, Value> args, outs;
};

struct Scenario {
  std::string name;
  std::vector<Stmt> stmts;
};

std::string trim(const std::string &s) {
  size_t a = s.find_first_not_of(" \t\r"), b = s.find_last_not_of(" \t\r");
  return a == std::string::npos ? "" : s.substr(a, b - a + 1);
}

std::vector<Scenario> parse_file(const std::string &path, const std::string &stem) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::vector<Scenario> out;
  std::string line;
  for (int n = 1; std::getline(in, line); n++) {
    line = trim(line);
    if (line.empty() || line[0] == '#') continue;
    if (line.rfind("scenario ", 0) == 0) {
      out.push_back({stem + "/" + trim(line.substr(9)), {}});
      continue;
    }
    if (out.empty()) throw std::runtime_error(path + ": a call before the first scenario");
    Stmt st;
    st.where = stem + ".txt:" + std::to_string(n) + ": " + line;
    size_t q = line.find('"');
    if (q != std::string::npos) {
      size_t e = line.rfind('"');
      st.frag = line.substr(q + 1, e - q - 1);
      line = trim(line.substr(0, q));
    }
    size_t arrow = line.find("->");
    if (arrow == std::string::npos) throw std::runtime_error(st.where + ": no '->'");
    std::stringstream lhs(line.substr(0, arrow)), rhs(line.substr(arrow + 2));
    std::string w;
    lhs >> st.call;
    while (lhs >> w) {
      size_t eq = w.find('=');
      st.args[w.substr(0, eq)] = parse_value(w.substr(eq + 1));
    }
    rhs >> st.want;
    while (rhs >> w) {
      size_t eq = w.find('=');
      st.outs[w.substr(0, eq)] = parse_value(w.substr(eq + 1));
    }
    out.back().stmts.push_back(st);
  }
  return out;
}

std::vector<Scenario> all_scenarios() {
  std::vector<std::string> files;
  if (DIR *d = opendir(KVPLUG_SCENARIOS)) {
    while (dirent *e = readdir(d)) {
      std::string f = e->d_name;
      if (f.size() > 4 && f.substr(f.size() - 4) == ".txt") files.push_back(f);
    }
    closedir(d);
  }
  std::sort(files.begin(), files.end());
  std::vector<Scenario> out;
  for (const std::string &f : files) {
    auto s = parse_file(std::string(KVPLUG_SCENARIOS) + "/" + f, f.substr(0, f.size() - 4));
    out.insert(out.end(), s.begin(), s.end());
  }
  return out;
}

// Field tables of the structs whose fields scenarios set or read.
struct Field {
  size_t off, size;
};
using Fields = std::map<std::string, Field>;
#define F(T, f) {#f, {offsetof(T, f), sizeof(((T *)nullptr)->f)}}

const std::map<std::string, std::pair<size_t, Fields>> &layouts() {
  static const std::map<std::string, std::pair<size_t, Fields>> l = {
      {"kvp_manager_config",
       {sizeof(kvp_manager_config),
        {F(kvp_manager_config, num_blocks), F(kvp_manager_config, block_size), F(kvp_manager_config, enable_prefix_cache),
         F(kvp_manager_config, enable_kv_events), F(kvp_manager_config, max_pending_events)}}},
      {"kvp_manager_stats",
       {sizeof(kvp_manager_stats),
        {F(kvp_manager_stats, num_blocks), F(kvp_manager_stats, block_size), F(kvp_manager_stats, free_blocks),
         F(kvp_manager_stats, used_blocks), F(kvp_manager_stats, peak_used_blocks), F(kvp_manager_stats, cached_blocks),
         F(kvp_manager_stats, shared_blocks), F(kvp_manager_stats, num_seqs), F(kvp_manager_stats, num_tokens),
         F(kvp_manager_stats, allocated_slots), F(kvp_manager_stats, internal_waste)}}},
      {"kvp_prefix_stats",
       {sizeof(kvp_prefix_stats),
        {F(kvp_prefix_stats, queries), F(kvp_prefix_stats, query_tokens), F(kvp_prefix_stats, hit_tokens),
         F(kvp_prefix_stats, partial_tokens), F(kvp_prefix_stats, inserts), F(kvp_prefix_stats, dedups),
         F(kvp_prefix_stats, evictions), F(kvp_prefix_stats, events_dropped), F(kvp_prefix_stats, cached_blocks),
         F(kvp_prefix_stats, locked_blocks), F(kvp_prefix_stats, pinned_blocks), F(kvp_prefix_stats, evictable_blocks),
         F(kvp_prefix_stats, pending_events), F(kvp_prefix_stats, uncomputed_blocks),
         F(kvp_prefix_stats, dropped_uncomputed)}}},
      {"kvp_vcache_config",
       {sizeof(kvp_vcache_config),
        {F(kvp_vcache_config, backend), F(kvp_vcache_config, device), F(kvp_vcache_config, num_layers),
         F(kvp_vcache_config, num_kv_heads), F(kvp_vcache_config, head_dim), F(kvp_vcache_config, dtype_bytes),
         F(kvp_vcache_config, max_batch), F(kvp_vcache_config, max_context), F(kvp_vcache_config, page_size),
         F(kvp_vcache_config, budget_bytes), F(kvp_vcache_config, reclaim_below_bytes),
         F(kvp_vcache_config, lookahead_tokens), F(kvp_vcache_config, no_background)}}},
      {"kvp_vcache_stats",
       {sizeof(kvp_vcache_stats),
        {F(kvp_vcache_stats, page_size), F(kvp_vcache_stats, budget_bytes), F(kvp_vcache_stats, tensor_bytes),
         F(kvp_vcache_stats, mapped_bytes), F(kvp_vcache_stats, held_bytes), F(kvp_vcache_stats, active_slots),
         F(kvp_vcache_stats, reusable_slots), F(kvp_vcache_stats, steps), F(kvp_vcache_stats, map_calls),
         F(kvp_vcache_stats, unmap_calls), F(kvp_vcache_stats, create_calls), F(kvp_vcache_stats, release_calls),
         F(kvp_vcache_stats, out_of_memory)}}},
      {"kvp_kv_write_args", {sizeof(kvp_kv_write_args), {}}},
      {"kvp_paged_decode_args", {sizeof(kvp_paged_decode_args), {}}},
      {"kvp_merge_states_args", {sizeof(kvp_merge_states_args), {}}},
      {"kvp_prefill_plan_args", {sizeof(kvp_prefill_plan_args), {}}},
      {"kvp_paged_prefill_args", {sizeof(kvp_paged_prefill_args), {}}},
      {"kvp_cascade_plan_args", {sizeof(kvp_cascade_plan_args), {}}},
      {"kvp_event_publisher_config",
       {sizeof(kvp_event_publisher_config),
        {F(kvp_event_publisher_config, endpoint), F(kvp_event_publisher_config, replay_endpoint),
         F(kvp_event_publisher_config, topic), F(kvp_event_publisher_config, medium),
         F(kvp_event_publisher_config, bind_mode), F(kvp_event_publisher_config, event_format),
         F(kvp_event_publisher_config, hash_format), F(kvp_event_publisher_config, data_parallel_rank),
         F(kvp_event_publisher_config, buffer_steps), F(kvp_event_publisher_config, hwm),
         F(kvp_event_publisher_config, max_batch_events), F(kvp_event_publisher_config, flush_interval_us),
         F(kvp_event_publisher_config, buffer_bytes)}}},
      {"kvp_event_publisher_stats",
       {sizeof(kvp_event_publisher_stats),
        {F(kvp_event_publisher_stats, batches), F(kvp_event_publisher_stats, events), F(kvp_event_publisher_stats, bytes),
         F(kvp_event_publisher_stats, dropped_sends), F(kvp_event_publisher_stats, replay_requests),
         F(kvp_event_publisher_stats, replay_batches), F(kvp_event_publisher_stats, snapshots),
         F(kvp_event_publisher_stats, source_errors), F(kvp_event_publisher_stats, buffered_batches),
         F(kvp_event_publisher_stats, buffered_bytes), F(kvp_event_publisher_stats, subscribers),
         F(kvp_event_publisher_stats, pub_port), F(kvp_event_publisher_stats, replay_port)}}},
  };
  return l;
}
#undef F

// The vcache stats a failed call must leave alone (its refusal and time
// counters move even when nothing changes).
const char *const kVcacheState[] = {"page_size",    "budget_bytes", "tensor_bytes", "mapped_bytes",
                                    "held_bytes",   "active_slots", "reusable_slots", "steps",
                                    "map_calls",    "unmap_calls",  "create_calls", "release_calls"};

// Struct fields that hold a C string, given as a word.
bool string_field(const std::string &f) {
  return f == "endpoint" || f == "replay_endpoint" || f == "topic" || f == "medium";
}

class Runner {
 public:
  ~Runner() {
    kvp_event_publisher_destroy(pub_);  // before its manager, as the header asks
    kvp_manager_destroy(m_);
    kvp_vcache_destroy(c_);
    for (kvp_manager *h : helper_m_) kvp_manager_destroy(h);
    for (kvp_vcache *h : helper_c_) kvp_vcache_destroy(h);
  }

  void run(const Stmt &st) {
    st_ = &st;
    results_.clear();
    bufs_.clear();
    std::string want = st.want == "OK" ? "KVP_OK" : "KVP_ERR_" + st.want;
    std::string before = st.want != "OK" ? snapshot() : "";
    kvp_status got = dispatch();
    ASSERT_EQ(std::string(kvp_status_string(got)), want) << st.where << "\n  " << kvp_last_error();
    if (got != KVP_OK) {
      std::string msg = kvp_last_error();
      ASSERT_FALSE(msg.empty()) << st.where << ": failed without a message";
      ASSERT_NE(msg.find(st.frag), std::string::npos) << st.where << "\n  message: " << msg;
      ASSERT_EQ(snapshot(), before) << st.where << ": a failed call changed the state";
    }
    for (const auto &kv : st.outs) {
      auto it = results_.find(kv.first);
      ASSERT_NE(it, results_.end()) << st.where << ": the call has no output " << kv.first;
      std::vector<int64_t> want_v = kv.second.is_list ? kv.second.list() : std::vector<int64_t>{std::stoll(kv.second.raw)};
      ASSERT_EQ(it->second, want_v) << st.where << ": output " << kv.first;
    }
  }

 private:
  const Stmt *st_ = nullptr;
  kvp_manager *m_ = nullptr;
  kvp_vcache *c_ = nullptr;
  kvp_event_publisher *pub_ = nullptr;
  kvp_event_publisher *stale_pub_ = nullptr;
  std::vector<kvp_manager *> helper_m_;
  std::vector<kvp_vcache *> helper_c_;
  kvp_manager *stale_m_ = nullptr;
  kvp_vcache *stale_c_ = nullptr;
  uint64_t junk_[8] = {};
  uint64_t last_pin_ = 0;
  std::vector<std::unique_ptr<std::vector<uint8_t>>> bufs_;
  std::map<std::string, std::vector<int64_t>> results_;

  bool has(const std::string &k) const { return st_->args.count(k) > 0; }
  bool null(const std::string &k) const { return has(k) && st_->args.at(k).null; }
  int64_t num(const std::string &k, int64_t def = 0) const { return has(k) ? std::stoll(st_->args.at(k).raw) : def; }
  std::vector<int64_t> list(const std::string &k) const {
    return has(k) && !null(k) ? st_->args.at(k).list() : std::vector<int64_t>{};
  }

  void *alloc(size_t n) {
    bufs_.push_back(std::make_unique<std::vector<uint8_t>>(n > 0 ? n : 1, 0));
    return bufs_.back()->data();
  }
  template <typename T>
  T *array(const std::vector<int64_t> &v) {
    T *p = static_cast<T *>(alloc(sizeof(T) * v.size()));
    for (size_t i = 0; i < v.size(); i++) p[i] = static_cast<T>(v[i]);
    return p;
  }
  template <typename T>
  T *arg_array(const std::string &k) {
    return null(k) ? nullptr : array<T>(list(k));
  }
  template <typename T>
  T *out(const std::string &k, size_t count) {
    return null(k) ? nullptr : static_cast<T *>(alloc(sizeof(T) * count));
  }

  size_t struct_size(const std::string &k, const std::string &name) const {
    size_t size = layouts().at(name).first;
    if (!has(k)) return size;
    std::string v = st_->args.at(k).raw;
    if (v.rfind("FULL", 0) == 0) return size + (v.size() > 4 ? std::stoll(v.substr(4)) : 0);
    if (v.rfind("FIRST", 0) == 0) return offsetof(kvp_manager_config, block_size) + 4 + (v.size() > 5 ? std::stoll(v.substr(5)) : 0);
    return std::stoull(v);
  }

  // A struct in caller memory of at least struct_size bytes, its fields
  // from the call's arguments; nullptr for NULL.
  template <typename T>
  T *make_struct(const std::string &arg, const std::string &name, std::map<std::string, int64_t> values = {},
                 const std::map<std::string, std::string> &renames = {}) {
    if (null(arg)) return nullptr;
    const auto &l = layouts().at(name);
    size_t ss = struct_size("struct_size", name);
    uint8_t *p = static_cast<uint8_t *>(alloc(std::max(ss, l.first) + 8));
    std::memcpy(p, &ss, sizeof ss);
    for (const auto &kv : st_->args) {
      auto rn = renames.find(kv.first);
      std::string f = rn == renames.end() ? kv.first : rn->second;
      if (!l.second.count(f)) continue;
      if (string_field(f)) {
        char *str = nullptr;
        if (!kv.second.null) {
          str = static_cast<char *>(alloc(kv.second.raw.size() + 1));
          std::memcpy(str, kv.second.raw.c_str(), kv.second.raw.size() + 1);
        }
        std::memcpy(p + l.second.at(f).off, &str, sizeof str);
        continue;
      }
      values[f] = num(kv.first);
    }
    for (const auto &kv : values) {
      const Field &f = l.second.at(kv.first);
      if (f.size == 4) {
        int32_t x = static_cast<int32_t>(kv.second);
        std::memcpy(p + f.off, &x, 4);
      } else {
        int64_t x = kv.second;
        std::memcpy(p + f.off, &x, 8);
      }
    }
    if (has("byte")) {
      std::string b = st_->args.at("byte").raw;
      p[b.rfind("FULL", 0) == 0 ? struct_size("byte", name) : std::stoull(b)] = 1;
    }
    return reinterpret_cast<T *>(p);
  }

  void read_struct(const std::string &name, const void *p) {
    for (const auto &kv : layouts().at(name).second) {
      if (string_field(kv.first)) continue;
      const uint8_t *q = static_cast<const uint8_t *>(p) + kv.second.off;
      if (kv.second.size == 4) {
        int32_t x;
        std::memcpy(&x, q, 4);
        results_[kv.first] = {x};
      } else {
        int64_t x;
        std::memcpy(&x, q, 8);
        results_[kv.first] = {x};
      }
    }
  }

  kvp_manager *new_manager() {
    kvp_manager_config cfg = KVP_MANAGER_CONFIG_INIT;
    cfg.num_blocks = 4;
    cfg.block_size = 4;
    kvp_manager *h = nullptr;
    EXPECT_EQ(kvp_manager_create(&cfg, &h), KVP_OK) << kvp_last_error();
    return h;
  }
  kvp_vcache *new_vcache() {
    kvp_vcache_config cfg = KVP_VCACHE_CONFIG_INIT;
    cfg.backend = KVP_VMEM_HOST;
    cfg.num_layers = cfg.num_kv_heads = 1;
    cfg.head_dim = 64;
    cfg.max_batch = 1;
    cfg.max_context = 64;
    cfg.budget_bytes = 1 << 20;
    kvp_vcache *h = nullptr;
    EXPECT_EQ(kvp_vcache_create(&cfg, &h), KVP_OK) << kvp_last_error();
    return h;
  }

  // The handle a call acts on: the current one, or m= / c= as given.
  void *handle(bool manager) {
    std::string k = manager ? "m" : "c";
    void *cur = manager ? static_cast<void *>(m_) : static_cast<void *>(c_);
    if (!has(k)) return cur;
    std::string v = st_->args.at(k).raw;
    if (v == "NULL") return nullptr;
    if (v == "junk") return junk_;
    if (v == "stale") {
      if (manager && !stale_m_) {
        stale_m_ = new_manager();
        kvp_manager_destroy(stale_m_);
      }
      if (!manager && !stale_c_) {
        stale_c_ = new_vcache();
        kvp_vcache_destroy(stale_c_);
      }
      return manager ? static_cast<void *>(stale_m_) : static_cast<void *>(stale_c_);
    }
    if (v == "other") {
      if (manager && c_) return c_;
      if (!manager && m_) return m_;
      if (manager) {
        helper_c_.push_back(new_vcache());
        return helper_c_.back();
      }
      helper_m_.push_back(new_manager());
      return helper_m_.back();
    }
    throw std::runtime_error("unknown handle " + v);
  }
  kvp_manager *mh() { return static_cast<kvp_manager *>(handle(true)); }
  kvp_vcache *ch() { return static_cast<kvp_vcache *>(handle(false)); }

  std::string snapshot() {
    std::string s;
    if (m_) {
      kvp_manager_stats ms = KVP_MANAGER_STATS_INIT;
      kvp_prefix_stats ps = KVP_PREFIX_STATS_INIT;
      EXPECT_EQ(kvp_manager_stats_get(m_, &ms), KVP_OK);
      EXPECT_EQ(kvp_manager_prefix_stats(m_, &ps), KVP_OK);
      // A running publisher drains the manager's events on its own thread:
      // the pending count moves between any two calls.
      if (pub_) ps.pending_events = 0;
      s.append(reinterpret_cast<const char *>(&ms), sizeof ms);
      s.append(reinterpret_cast<const char *>(&ps), sizeof ps);
    }
    if (c_) {
      kvp_vcache_stats vs = KVP_VCACHE_STATS_INIT;
      EXPECT_EQ(kvp_vcache_stats_get(c_, &vs), KVP_OK);
      const Fields &f = layouts().at("kvp_vcache_stats").second;
      for (const char *name : kVcacheState)
        s.append(reinterpret_cast<const char *>(&vs) + f.at(name).off, f.at(name).size);
    }
    return s;
  }

  // One kvp_prefix_keys per prompt when the call gives salt_len or num_mm.
  kvp_prefix_keys *keys(size_t n) {
    if (!has("salt_len") && !has("num_mm")) return nullptr;
    kvp_prefix_keys *k = static_cast<kvp_prefix_keys *>(alloc(sizeof(kvp_prefix_keys) * n));
    uint8_t *salt = static_cast<uint8_t *>(alloc(static_cast<size_t>(std::max<int64_t>(num("salt_len"), 1))));
    for (size_t i = 0; i < n; i++) {
      k[i].salt_len = static_cast<int32_t>(num("salt_len"));
      k[i].salt = salt;
      k[i].num_mm = static_cast<int32_t>(num("num_mm"));
    }
    return k;
  }

  kvp_status dispatch() {
    const std::string &call = st_->call;
    auto i32 = [&](const std::string &k, int64_t def = 0) { return static_cast<int32_t>(num(k, def)); };
    if (call == "manager_create") {
      auto *cfg = make_struct<kvp_manager_config>("cfg", "kvp_manager_config", {},
                                                  {{"prefix_cache", "enable_prefix_cache"}, {"kv_events", "enable_kv_events"}});
      kvp_manager **o = out<kvp_manager *>("out", 1);
      kvp_status s = kvp_manager_create(cfg, o);
      if (s == KVP_OK) {
        kvp_event_publisher_destroy(pub_);
        pub_ = nullptr;
        kvp_manager_destroy(m_);
        m_ = *o;
      }
      return s;
    }
    if (call == "manager_destroy") {
      kvp_manager_destroy(mh());
      if (!has("m")) m_ = nullptr;
      return KVP_OK;
    }
    if (call == "vcache_destroy") {
      kvp_vcache_destroy(ch());
      if (!has("c")) c_ = nullptr;
      return KVP_OK;
    }
    if (call == "manager_add") return kvp_manager_add(mh(), num("id"), i32("prompt_len"));
    if (call == "manager_mark_computed") return kvp_manager_mark_computed(mh());
    if (call == "manager_grow" || call == "manager_grow_tokens" || call == "manager_remove") {
      int32_t n = i32("n", static_cast<int64_t>(list("ids").size()));
      if (call == "manager_remove") return kvp_manager_remove(mh(), arg_array<int64_t>("ids"), n);
      if (call == "manager_grow") return kvp_manager_grow(mh(), arg_array<int64_t>("ids"), arg_array<int32_t>("counts"), n);
      return kvp_manager_grow_tokens(mh(), arg_array<int64_t>("ids"), arg_array<int32_t>("counts"), n,
                                     arg_array<int32_t>("tokens"));
    }
    if (call == "manager_fork") {
      int32_t n = i32("n", static_cast<int64_t>(list("children").size()));
      int32_t mc = i32("max_copies");
      int32_t *num_copies = out<int32_t>("num_copies", 1);
      kvp_status s = kvp_manager_fork(mh(), num("parent"), arg_array<int64_t>("children"), n,
                                      out<kvp_block_copy>("copies", static_cast<size_t>(std::max(mc, 0))), mc, num_copies);
      if (s == KVP_OK) results_["num_copies"] = {*num_copies};
      return s;
    }
    if (call == "manager_describe") {
      int32_t n = i32("n", static_cast<int64_t>(list("ids").size()));
      int32_t mb = i32("max_blocks"), cap = i32("slot_capacity");
      size_t nn = static_cast<size_t>(std::max(n, 0));
      int32_t *lens = out<int32_t>("seq_lens", nn), *num_slots = out<int32_t>("num_slots", 1);
      kvp_status s = kvp_manager_describe(mh(), arg_array<int64_t>("ids"), n,
                                          out<int32_t>("block_table", nn * static_cast<size_t>(std::max(mb, 0))), mb, lens,
                                          out<int32_t>("slot_mapping", static_cast<size_t>(std::max(cap, 0))), cap, num_slots);
      if (s == KVP_OK) {
        results_["num_slots"] = {*num_slots};
        results_["seq_lens"] = std::vector<int64_t>(lens, lens + n);
      }
      return s;
    }
    if (call == "manager_stats_get") {
      auto *o = make_struct<kvp_manager_stats>("out", "kvp_manager_stats");
      kvp_status s = kvp_manager_stats_get(mh(), o);
      if (s == KVP_OK) read_struct("kvp_manager_stats", o);
      return s;
    }
    if (call == "manager_prefix_stats") {
      auto *o = make_struct<kvp_prefix_stats>("out", "kvp_prefix_stats");
      kvp_status s = kvp_manager_prefix_stats(mh(), o);
      if (s == KVP_OK) read_struct("kvp_prefix_stats", o);
      return s;
    }
    if (call == "vcache_stats_get") {
      auto *o = make_struct<kvp_vcache_stats>("out", "kvp_vcache_stats");
      kvp_status s = kvp_vcache_stats_get(ch(), o);
      if (s == KVP_OK) read_struct("kvp_vcache_stats", o);
      return s;
    }
    if (call == "manager_admit" || call == "manager_match") {
      const auto &prompts = st_->args.at("prompts").lists;
      int32_t n = i32("n", static_cast<int64_t>(prompts.size()));
      std::vector<int64_t> toks, offs{0};
      for (const auto &p : prompts) {
        toks.insert(toks.end(), p.begin(), p.end());
        offs.push_back(static_cast<int64_t>(toks.size()));
      }
      int32_t *tokens = null("tokens") ? nullptr : array<int32_t>(toks);
      int64_t *offsets = has("offsets") ? arg_array<int64_t>("offsets") : array<int64_t>(offs);
      kvp_prefix_keys *k = keys(prompts.size());
      if (call == "manager_match") {
        kvp_prefix_match *o = out<kvp_prefix_match>("out", prompts.size());
        kvp_status s = kvp_manager_match(mh(), n, tokens, offsets, k, i32("partial"), o);
        if (s == KVP_OK) {
          for (size_t i = 0; i < prompts.size(); i++) {
            results_["matched"].push_back(o[i].matched_tokens);
            results_["partial_block"].push_back(o[i].partial_block);
            results_["partial_tokens"].push_back(o[i].partial_tokens);
          }
        }
        return s;
      }
      int32_t *matched = static_cast<int32_t *>(alloc(4 * prompts.size()));
      int32_t *num_admitted = out<int32_t>("num_admitted", 1);
      kvp_status s = kvp_manager_admit(mh(), arg_array<int64_t>("ids"), n, tokens, offsets, k, matched, num_admitted);
      if (s == KVP_OK) {
        results_["num_admitted"] = {*num_admitted};
        results_["matched"] = std::vector<int64_t>(matched, matched + *num_admitted);
      }
      return s;
    }
    if (call == "manager_pin" || call == "manager_set_priority") {
      int32_t n = i32("num_tokens", static_cast<int64_t>(list("tokens").size()));
      int32_t nb = -1;
      kvp_status s;
      if (call == "manager_set_priority") {
        s = kvp_manager_set_priority(mh(), arg_array<int32_t>("tokens"), n, nullptr, i32("priority"), &nb);
      } else {
        uint64_t *id = out<uint64_t>("pin_id", 1);
        s = kvp_manager_pin(mh(), arg_array<int32_t>("tokens"), n, nullptr, id, &nb);
        if (s == KVP_OK) last_pin_ = *id;
      }
      if (s == KVP_OK) results_["num_blocks"] = {nb};
      return s;
    }
    if (call == "manager_unpin")
      return kvp_manager_unpin(mh(), st_->args.at("pin_id").raw == "last" ? last_pin_ : static_cast<uint64_t>(num("pin_id")));
    if (call == "manager_clear_prefix_cache") {
      int32_t freed = -1;
      kvp_status s = kvp_manager_clear_prefix_cache(mh(), &freed);
      if (s == KVP_OK) results_["num_freed"] = {freed};
      return s;
    }
    if (call == "manager_drain_events") {
      int32_t me = i32("max_events"), mt = i32("max_tokens"), mm = i32("max_mm"), mhs = i32("max_hashes");
      auto cnt = [](int32_t x) { return static_cast<size_t>(std::max(x, 1)); };
      int32_t *num_events = out<int32_t>("num_events", 1);
      kvp_status s = kvp_manager_drain_events(mh(), out<kvp_kv_event>("events", cnt(me)), me, out<int32_t>("tokens", cnt(mt)), mt,
                                              static_cast<kvp_block_mm *>(alloc(sizeof(kvp_block_mm) * cnt(mm))), mm,
                                              static_cast<uint8_t *>(alloc(16 * cnt(mhs))), mhs, num_events);
      if (s == KVP_OK) results_["num_events"] = {*num_events};
      return s;
    }
    if (call == "manager_next_event_size") {
      int32_t t = -1, mm = -1, h = -1;
      kvp_status s = kvp_manager_next_event_size(mh(), &t, &mm, &h);
      if (s == KVP_OK) results_["tokens"] = {t}, results_["mm"] = {mm}, results_["hashes"] = {h};
      return s;
    }
    if (call == "manager_add_mm_items") {
      if (!null("items")) throw std::runtime_error("only items=NULL is supported");
      return kvp_manager_add_mm_items(mh(), num("seq_id"), nullptr, i32("num_items"));
    }
    if (call == "vcache_create") {
      auto *cfg = make_struct<kvp_vcache_config>("cfg", "kvp_vcache_config", {{"backend", 1}, {"no_background", 1}});
      kvp_vcache **o = out<kvp_vcache *>("out", 1);
      kvp_status s = kvp_vcache_create(cfg, o);
      if (s == KVP_OK) {
        kvp_vcache_destroy(c_);
        c_ = *o;
      }
      return s;
    }
    if (call == "vcache_alloc_slot") {
      int32_t *slot = out<int32_t>("slot", 1);
      kvp_status s = kvp_vcache_alloc_slot(ch(), slot);
      if (s == KVP_OK) results_["slot"] = {*slot};
      return s;
    }
    if (call == "vcache_free_slot") return kvp_vcache_free_slot(ch(), i32("slot"));
    if (call == "vcache_step")
      return kvp_vcache_step(ch(), arg_array<int32_t>("slots"), arg_array<int32_t>("ctx_lens"),
                             i32("n", static_cast<int64_t>(list("slots").size())));
    if (call == "vcache_layer_ptrs") return kvp_vcache_layer_ptrs(ch(), i32("layer"), out<uint64_t>("k_ptr", 1), out<uint64_t>("v_ptr", 1));
    if (call == "vcache_strides") return kvp_vcache_strides(ch(), out<int64_t>("strides", 4));
    if (call == "vcache_trim") return kvp_vcache_trim(ch());
    if (call == "attn_workspace_size" || call == "prefill_workspace_size") {
      uint64_t *o = out<uint64_t>("out", 1);
      kvp_status s = call == "attn_workspace_size"
                         ? kvp_attn_workspace_size(i32("max_batch"), i32("num_q_heads"), i32("head_dim"), i32("max_splits"), o)
                         : kvp_prefill_workspace_size(i32("max_batch"), i32("max_tokens"), i32("num_q_heads"),
                                                      i32("num_kv_heads"), i32("head_dim"), o);
      if (s == KVP_OK) results_["bytes"] = {static_cast<int64_t>(*o)};
      return s;
    }
    if (call == "attn_num_splits") {
      int32_t *o = out<int32_t>("out", 1);
      kvp_status s = kvp_attn_num_splits(i32("dtype"), i32("head_dim"), i32("batch"), i32("num_q_heads"), i32("num_kv_heads"),
                                         i32("max_seq_len"), o);
      if (s == KVP_OK) results_["splits"] = {*o};
      return s;
    }
    if (call == "kv_write") return kvp_kv_write(make_struct<kvp_kv_write_args>("args", "kvp_kv_write_args"), 0);
    if (call == "paged_decode") return kvp_paged_decode(make_struct<kvp_paged_decode_args>("args", "kvp_paged_decode_args"), 0);
    if (call == "merge_states") return kvp_merge_states(make_struct<kvp_merge_states_args>("args", "kvp_merge_states_args"), 0);
    if (call == "prefill_plan" || call == "paged_prefill") {
      kvp_attn_plan plan = KVP_ATTN_PLAN_INIT;
      if (call == "prefill_plan") return kvp_prefill_plan(make_struct<kvp_prefill_plan_args>("args", "kvp_prefill_plan_args"), &plan, 0);
      return kvp_paged_prefill(&plan, make_struct<kvp_paged_prefill_args>("args", "kvp_paged_prefill_args"), 0);
    }
    return dispatch_more();
  }

  // The shared-prefix attention and event publisher calls.
  kvp_status dispatch_more() {
    const std::string &call = st_->call;
    auto i32 = [&](const std::string &k, int64_t def = 0) { return static_cast<int32_t>(num(k, def)); };
    kvp_attn_plan plan = KVP_ATTN_PLAN_INIT;
    if (call == "cascade_workspace_size") {
      uint64_t *dev = out<uint64_t>("device_bytes", 1), *host = out<uint64_t>("host_bytes", 1);
      kvp_status s = kvp_cascade_workspace_size(i32("max_batch"), i32("num_q_heads"), i32("num_kv_heads"), i32("head_dim"), dev, host);
      if (s == KVP_OK) results_["device_bytes"] = {static_cast<int64_t>(*dev)}, results_["host_bytes"] = {static_cast<int64_t>(*host)};
      return s;
    }
    if (call == "cascade_plan") return kvp_cascade_plan(make_struct<kvp_cascade_plan_args>("args", "kvp_cascade_plan_args"), &plan, 0);
    if (call == "cascade_update") {
      int32_t batch = i32("batch");
      std::vector<int64_t> lens = has("seq_lens_host") ? list("seq_lens_host") : std::vector<int64_t>(std::max(batch, 0), 0);
      int32_t *l = null("seq_lens_host") ? nullptr : array<int32_t>(lens);
      return kvp_cascade_update(null("plan") ? nullptr : &plan, l, batch, out<int32_t>("fits", 1));
    }
    if (call == "paged_cascade") return kvp_paged_cascade(&plan, make_struct<kvp_paged_prefill_args>("args", "kvp_paged_prefill_args"), 0);
    if (call == "event_publisher_create") {
      auto *cfg = make_struct<kvp_event_publisher_config>("cfg", "kvp_event_publisher_config");
      kvp_event_publisher **o = out<kvp_event_publisher *>("out", 1);
      kvp_status s = kvp_event_publisher_create(mh(), cfg, o);
      if (s == KVP_OK) {
        kvp_event_publisher_destroy(pub_);
        pub_ = *o;
      }
      return s;
    }
    if (call == "event_publisher_flush") return kvp_event_publisher_flush(publisher());
    if (call == "event_publisher_resync") return kvp_event_publisher_resync(publisher());
    if (call == "event_publisher_stats_get") {
      auto *o = make_struct<kvp_event_publisher_stats>("out", "kvp_event_publisher_stats");
      kvp_status s = kvp_event_publisher_stats_get(publisher(), o);
      if (s == KVP_OK) read_struct("kvp_event_publisher_stats", o);
      return s;
    }
    if (call == "event_publisher_destroy") {
      kvp_event_publisher_destroy(publisher());
      if (!has("p")) pub_ = nullptr;
      return KVP_OK;
    }
    throw std::runtime_error(st_->where + ": unknown call " + call);
  }

  // The p= argument: the current publisher, NULL, junk, stale (created and
  // destroyed) or other (the current manager).
  kvp_event_publisher *publisher() {
    if (!has("p")) return pub_;
    std::string v = st_->args.at("p").raw;
    if (v == "NULL") return nullptr;
    if (v == "junk") return reinterpret_cast<kvp_event_publisher *>(junk_);
    if (v == "other") return reinterpret_cast<kvp_event_publisher *>(m_);
    if (v == "stale") {
      if (!stale_pub_) {
        kvp_manager_config cfg = KVP_MANAGER_CONFIG_INIT;
        cfg.num_blocks = cfg.block_size = 4;
        cfg.enable_prefix_cache = cfg.enable_kv_events = 1;
        kvp_manager *m = nullptr;
        EXPECT_EQ(kvp_manager_create(&cfg, &m), KVP_OK) << kvp_last_error();
        kvp_event_publisher_config pc = KVP_EVENT_PUBLISHER_CONFIG_INIT;
        pc.endpoint = "tcp://127.0.0.1:0";
        EXPECT_EQ(kvp_event_publisher_create(m, &pc, &stale_pub_), KVP_OK) << kvp_last_error();
        kvp_event_publisher_destroy(stale_pub_);
        kvp_manager_destroy(m);
      }
      return stale_pub_;
    }
    throw std::runtime_error("unknown publisher p=" + v);
  }
};

class Scenarios : public ::testing::TestWithParam<Scenario> {};

TEST_P(Scenarios, Run) {
  Runner r;
  for (const Stmt &st : GetParam().stmts) {
    ASSERT_NO_FATAL_FAILURE(r.run(st));
  }
}

std::string case_name(const ::testing::TestParamInfo<Scenario> &info) {
  std::string n = info.param.name;
  for (char &ch : n)
    if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return n;
}

INSTANTIATE_TEST_SUITE_P(Files, Scenarios, ::testing::ValuesIn(all_scenarios()), case_name);

TEST(ScenarioFiles, AllThreeFilesHaveCases) {
  std::map<std::string, size_t> per_file;
  for (const Scenario &s : all_scenarios()) per_file[s.name.substr(0, s.name.find('/'))] += s.stmts.size();
  EXPECT_GT(per_file["bad_inputs"], 100u);
  EXPECT_GT(per_file["eviction"], 20u);
  EXPECT_GT(per_file["admission"], 20u);
}

TEST(ScenarioFiles, ValuesParseAsTheReadmeSays) {
  Value v = parse_value("[1,3..5,-2]/[]");
  ASSERT_EQ(v.lists.size(), 2u);
  EXPECT_EQ(v.lists[0], (std::vector<int64_t>{1, 3, 4, 5, -2}));
  EXPECT_TRUE(v.lists[1].empty());
  EXPECT_TRUE(parse_value("NULL").null);
  EXPECT_THROW(parse_value("[5..3]"), std::runtime_error);
}

}  // namespace
