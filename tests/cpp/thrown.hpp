// The C status behind a kvplug::Error that f throws (KVP_OK when it throws
// nothing), for tests that check the wrapper's exceptions carry the C
// status and a message.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "kvplug.hpp"

template <class F>
kvp_status thrown(F &&f) {
  try {
    f();
  } catch (const kvplug::Error &e) {
    EXPECT_NE(std::string(e.what()), "");
    return e.status();
  }
  return KVP_OK;
}
