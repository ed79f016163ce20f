// The prefix cache's block hashes recomputed in C++ from core/prefix/HASH.md
// (xxhash.h's XXH3-128) and checked against the test vectors the Go
// implementation generated: a C++ engine or router computes the same block
// identities as the library.
#include <gtest/gtest.h>
#include <xxhash.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#ifndef KVPLUG_HASH_VECTORS
#error "KVPLUG_HASH_VECTORS must name core/prefix/testdata/hash_vectors.json"
#endif

namespace {

// A minimal JSON reader: enough for the vectors file (objects, arrays,
// strings without escapes beyond \" and \\, integers, booleans, null).
struct Json {
  enum Kind { Null, Bool, Number, String, Array, Object } kind = Null;
  bool b = false;
  std::string num;  // kept as text: adapter ids are uint64
  std::string str;
  std::vector<Json> arr;
  std::map<std::string, Json> obj;

  const Json &operator[](const std::string &k) const {
    auto it = obj.find(k);
    if (it == obj.end()) throw std::runtime_error("missing key " + k);
    return it->second;
  }
  int64_t i64() const { return std::stoll(num); }
  uint64_t u64() const { return std::stoull(num); }
};

class Parser {
 public:
  explicit Parser(std::string s) : s_(std::move(s)) {}
  Json parse() {
    Json v = value();
    ws();
    if (p_ != s_.size()) throw std::runtime_error("trailing data");
    return v;
  }

 private:
  void ws() {
    while (p_ < s_.size() && std::strchr(" \t\r\n", s_[p_])) p_++;
  }
  char peek() {
    ws();
    if (p_ >= s_.size()) throw std::runtime_error("unexpected end");
    return s_[p_];
  }
  void expect(char c) {
    if (peek() != c) throw std::runtime_error(std::string("expected ") + c);
    p_++;
  }
  std::string string() {
    expect('"');
    std::string out;
    while (s_.at(p_) != '"') {
      if (s_[p_] == '\\') p_++;
      out += s_.at(p_++);
    }
    p_++;
    return out;
  }
  Json value() {
    Json v;
    char c = peek();
    if (c == '{') {
      v.kind = Json::Object;
      p_++;
      if (peek() == '}') { p_++; return v; }
      for (;;) {
        std::string k = string();
        expect(':');
        v.obj[k] = value();
        if (peek() == ',') { p_++; continue; }
        expect('}');
        return v;
      }
    }
    if (c == '[') {
      v.kind = Json::Array;
      p_++;
      if (peek() == ']') { p_++; return v; }
      for (;;) {
        v.arr.push_back(value());
        if (peek() == ',') { p_++; continue; }
        expect(']');
        return v;
      }
    }
    if (c == '"') {
      v.kind = Json::String;
      v.str = string();
      return v;
    }
    if (s_.compare(p_, 4, "true") == 0) { v.kind = Json::Bool; v.b = true; p_ += 4; return v; }
    if (s_.compare(p_, 5, "false") == 0) { v.kind = Json::Bool; p_ += 5; return v; }
    if (s_.compare(p_, 4, "null") == 0) { p_ += 4; return v; }
    v.kind = Json::Number;
    while (p_ < s_.size() && std::strchr("-+0123456789.eE", s_[p_])) v.num += s_[p_++];
    if (v.num.empty()) throw std::runtime_error("bad value");
    return v;
  }
  std::string s_;
  size_t p_ = 0;
};

std::vector<uint8_t> from_hex(const std::string &h) {
  std::vector<uint8_t> out(h.size() / 2);
  for (size_t i = 0; i < out.size(); i++) out[i] = uint8_t(std::stoul(h.substr(2 * i, 2), nullptr, 16));
  return out;
}

std::string to_hex(const uint8_t *p, size_t n) {
  static const char d[] = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; i++) { s += d[p[i] >> 4]; s += d[p[i] & 15]; }
  return s;
}

template <typename T>
void put_le(std::vector<uint8_t> &b, T v) {
  for (size_t i = 0; i < sizeof(T); i++) b.push_back(uint8_t(uint64_t(v) >> (8 * i)));
}

struct MM { int32_t offset, length; std::vector<uint8_t> hash; };

// Block inputs and hashes per HASH.md's layout version 1.
std::vector<std::pair<std::vector<uint8_t>, std::vector<uint8_t>>> blocks_of(
    const std::vector<int32_t> &tokens, int bs, uint64_t adapter, const std::vector<MM> &mm,
    const std::vector<uint8_t> &salt) {
  std::vector<std::pair<std::vector<uint8_t>, std::vector<uint8_t>>> out;
  std::vector<uint8_t> parent(16, 0);
  for (size_t i = 0; i < tokens.size() / size_t(bs); i++) {
    const int32_t lo = int32_t(i) * bs, hi = lo + bs;
    std::vector<uint8_t> b{1};
    b.insert(b.end(), parent.begin(), parent.end());
    put_le<uint32_t>(b, uint32_t(bs));
    for (int32_t t = lo; t < hi; t++) put_le<uint32_t>(b, uint32_t(tokens[size_t(t)]));
    put_le<uint64_t>(b, adapter);
    std::vector<const MM *> ents;
    for (const MM &m : mm)
      if (m.offset < hi && m.offset + m.length > lo) ents.push_back(&m);
    put_le<uint32_t>(b, uint32_t(ents.size()));
    for (const MM *m : ents) {
      put_le<uint32_t>(b, uint32_t(m->offset - lo));
      b.insert(b.end(), m->hash.begin(), m->hash.end());
    }
    const size_t s = i == 0 ? salt.size() : 0;
    put_le<uint32_t>(b, uint32_t(s));
    b.insert(b.end(), salt.begin(), salt.begin() + long(s));
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, XXH3_128bits(b.data(), b.size()));
    parent.assign(c.digest, c.digest + 16);
    out.emplace_back(b, parent);
  }
  return out;
}

Json load() {
  std::ifstream f(KVPLUG_HASH_VECTORS);
  if (!f) throw std::runtime_error("cannot open " KVPLUG_HASH_VECTORS);
  std::stringstream ss;
  ss << f.rdbuf();
  return Parser(ss.str()).parse();
}

TEST(HashVectors, MatchTheGoImplementation) {
  const Json doc = load();
  ASSERT_EQ(doc["layout_version"].i64(), 1);
  const auto &vectors = doc["vectors"].arr;
  ASSERT_GE(vectors.size(), 10u);
  size_t checked = 0;
  for (const Json &v : vectors) {
    SCOPED_TRACE(v["name"].str);
    std::vector<int32_t> tokens;
    for (const Json &t : v["tokens"].arr) tokens.push_back(int32_t(t.i64()));
    std::vector<MM> mm;
    for (const Json &m : v["mm"].arr)
      mm.push_back({int32_t(m["offset"].i64()), int32_t(m["length"].i64()), from_hex(m["hash"].str)});
    const auto got = blocks_of(tokens, int(v["block_size"].i64()), v["adapter"].u64(), mm,
                               from_hex(v["salt"].str));
    const auto &want = v["blocks"].arr;
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); i++) {
      EXPECT_EQ(to_hex(got[i].first.data(), got[i].first.size()), want[i]["input"].str) << "block " << i;
      EXPECT_EQ(to_hex(got[i].second.data(), 16), want[i]["hash"].str) << "block " << i;
      checked++;
    }
  }
  EXPECT_GE(checked, 20u);
}

TEST(HashVectors, SaltSeparatesEveryBlock) {
  std::vector<int32_t> tokens(64);
  for (int i = 0; i < 64; i++) tokens[size_t(i)] = i;
  const auto a = blocks_of(tokens, 16, 0, {}, {});
  const auto b = blocks_of(tokens, 16, 0, {}, {'t', 'e', 'n', 'a', 'n', 't'});
  ASSERT_EQ(a.size(), 4u);
  for (size_t i = 0; i < a.size(); i++) EXPECT_NE(a[i].second, b[i].second) << "block " << i;
}

}  // namespace
