// The C++ wrapper in a process where the library cannot be loaded: the
// README's catch pattern handles the failure (no std::terminate from a
// status_string that needs the library), the failure is a LibraryError and
// not KVP_ERR_UNSUPPORTED, and a later call loads the library once it can.
//
// The tests run in the order written: the last one loads the library, so
// every test before it sees a process without it. ctest runs each test in a
// process of its own. KVPLUG_TEST_LIBRARY is the built library.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <type_traits>

#include "kvplug.hpp"

namespace {

static_assert(std::is_base_of<kvplug::Error, kvplug::LibraryError>::value,
              "catch (const kvplug::Error &) must catch a failure to load");
static_assert(noexcept(kvplug::status_string(KVP_OK)), "status_string is called from exception handlers");

const char *const kMissing = "/nonexistent/kvplug/libkvplug.so";

// The README's pattern: construct, catch kvplug::Error, print its status's
// name. Returns that name and the message; fails the test if nothing is thrown.
std::pair<std::string, std::string> readme_pattern() {
  try {
    kvplug::Manager m(64, 16);
    ADD_FAILURE() << "a Manager was created with no library to load";
  } catch (const kvplug::Error &e) {
    return {kvplug::status_string(e.status()), e.what()};
  }
  return {"", ""};
}

TEST(NoLibrary, ReadmeCatchPatternNamesTheFailure) {
  ASSERT_EQ(setenv("KVPLUG_LIBRARY", kMissing, 1), 0);
  auto [name, msg] = readme_pattern();
  EXPECT_EQ(name, "KVP_ERR_NOT_FOUND");
  EXPECT_NE(msg.find("cannot load"), std::string::npos) << msg;
  EXPECT_NE(msg.find(kMissing), std::string::npos) << msg;
  EXPECT_FALSE(kvplug::detail::loaded());
}

TEST(NoLibrary, TheFailureIsALibraryErrorNotUnsupported) {
  ASSERT_EQ(setenv("KVPLUG_LIBRARY", kMissing, 1), 0);
  bool caught = false;
  try {
    kvplug::version();
  } catch (const kvplug::LibraryError &e) {
    caught = true;
    EXPECT_NE(e.status(), KVP_ERR_UNSUPPORTED);
    EXPECT_EQ(e.status(), KVP_ERR_NOT_FOUND);
  }
  EXPECT_TRUE(caught);
  // An explicit path that does not exist: the same error, naming that path.
  try {
    kvplug::load("/also/missing/libkvplug.so");
    ADD_FAILURE() << "load of a missing path returned";
  } catch (const kvplug::LibraryError &e) {
    EXPECT_NE(std::string(e.what()).find("/also/missing/libkvplug.so"), std::string::npos) << e.what();
  }
}

TEST(NoLibrary, NotALibraryIsALibraryError) {
  // A file that exists and is no shared object.
  ASSERT_EQ(setenv("KVPLUG_LIBRARY", "/proc/self/status", 1), 0);
  EXPECT_THROW(kvplug::Manager(64, 16), kvplug::LibraryError);
}

TEST(NoLibrary, StatusStringNeedsNoLibrary) {
  ASSERT_FALSE(kvplug::detail::loaded());
  const char *names[] = {"KVP_OK",
                         "KVP_ERR_INVALID_ARGUMENT",
                         "KVP_ERR_NULL_POINTER",
                         "KVP_ERR_STRUCT_SIZE",
                         "KVP_ERR_INVALID_HANDLE",
                         "KVP_ERR_UNKNOWN_SEQUENCE",
                         "KVP_ERR_DUPLICATE_SEQUENCE",
                         "KVP_ERR_OUT_OF_BLOCKS",
                         "KVP_ERR_BUFFER_TOO_SMALL",
                         "KVP_ERR_NO_DEVICE",
                         "KVP_ERR_CUDA",
                         "KVP_ERR_UNSUPPORTED",
                         "KVP_ERR_OUT_OF_MEMORY",
                         "KVP_ERR_NOT_FOUND",
                         "KVP_ERR_INTERNAL",
                         "KVP_ERR_IN_USE"};
  for (int i = 0; i <= KVP_ERR_IN_USE; i++) EXPECT_STREQ(kvplug::status_string(static_cast<kvp_status>(i)), names[i]) << i;
  EXPECT_FALSE(kvplug::detail::loaded());  // and it did not load the library to find them
}

TEST(NoLibrary, UnsetAndNotOnTheSearchPath) {
  ASSERT_EQ(unsetenv("KVPLUG_LIBRARY"), 0);
  try {
    kvplug::Manager m(64, 16);
    GTEST_SKIP() << "libkvplug.so is on this machine's dynamic linker search path";
  } catch (const kvplug::LibraryError &e) {
    EXPECT_STREQ(kvplug::status_string(e.status()), "KVP_ERR_NOT_FOUND");
    EXPECT_NE(std::string(e.what()).find("libkvplug.so"), std::string::npos) << e.what();
  }
}

TEST(NoLibrary, ALaterCallLoadsTheLibraryOnceItIsThere) {
  if (kvplug::detail::loaded()) GTEST_SKIP() << "loaded from the search path already";
  ASSERT_EQ(setenv("KVPLUG_LIBRARY", kMissing, 1), 0);
  EXPECT_THROW(kvplug::version(), kvplug::LibraryError);
  ASSERT_EQ(setenv("KVPLUG_LIBRARY", KVPLUG_TEST_LIBRARY, 1), 0);
  kvplug::Manager m(64, 16);
  m.add(1, 10);
  EXPECT_TRUE(kvplug::detail::loaded());
  EXPECT_EQ(kvplug::load(), KVPLUG_TEST_LIBRARY);
}

}  // namespace
