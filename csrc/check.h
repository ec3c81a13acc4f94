// MPT_CHECK(cond, parts...): TORCH_CHECK with the message built here, without std::ostream.
//
// Why: on the GPU machine (torch 2.11 pip wheel, the system's g++), an extension whose
// TORCH_CHECK message streams a number or a Device through c10::str's std::ostringstream
// segfaults instead of raising -- g++ .cpp and nvcc .cu alike, torch's own load_inline
// included (reproduced by dev/diag_check_segv.py).  A message that reaches TORCH_CHECK as
// one std::string is passed through untouched and raises normally, so every part is
// converted to text here (std::to_string, Device::str, toString(ScalarType)).  The message
// is still built only when the check fails.
#pragma once
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <string>
#include <string_view>
#include <type_traits>

namespace mpt {

inline void msg_part(std::string& s, std::string_view v) { s.append(v.data(), v.size()); }
inline void msg_part(std::string& s, const char* v) { s.append(v ? v : "(null)"); }
inline void msg_part(std::string& s, const std::string& v) { s.append(v); }
inline void msg_part(std::string& s, char v) { s.push_back(v); }
inline void msg_part(std::string& s, bool v) { s.append(v ? "true" : "false"); }
inline void msg_part(std::string& s, const c10::Device& v) { s.append(v.str()); }
inline void msg_part(std::string& s, c10::ScalarType v) { s.append(c10::toString(v)); }
inline void msg_part(std::string& s, c10::IntArrayRef v) {
  s.push_back('[');
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s.append(", ");
    s.append(std::to_string(v[i]));
  }
  s.push_back(']');
}
template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool> &&
                                           !std::is_same_v<T, char>, int> = 0>
inline void msg_part(std::string& s, T v) {
  s.append(std::to_string(v));
}
template <typename T, std::enable_if_t<std::is_floating_point_v<T>, int> = 0>
inline void msg_part(std::string& s, T v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", static_cast<double>(v));
  s.append(buf);
}

template <typename... Parts>
std::string msg(const Parts&... parts) {
  std::string s;
  (msg_part(s, parts), ...);
  return s;
}

}  // namespace mpt

#define MPT_CHECK(cond, ...) TORCH_CHECK(cond, ::mpt::msg(__VA_ARGS__))
