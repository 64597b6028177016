// The instruction sets the kernels may use. Chosen once, when the kernels load
// (braid/kernels/__init__.py: all this CPU has, or BRAID_KERNEL_ISA), and passed to every op:
// no op reads a setting that anything can change under it, and a test compares two paths by
// passing each.
#pragma once

#include <stdexcept>
#include <string>

#if defined(__x86_64__) || defined(_M_X64)
#define BRAID_X86 1
#endif

namespace braid_kernels {

struct Isa {
  bool avx2 = false;    // quant.cpp's row kernels, norm.cpp's and attention.cpp's vector paths
  bool avx512 = false;  // the AVX512 activation quantizer, SiLU and attention (with avx2)
  bool vnni = false;    // panels.cpp's AVX512-VNNI products of weights in panels (with avx512)
};

inline bool cpu_has_avx2() {
#ifdef BRAID_X86
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

inline bool cpu_has_avx512() {
#ifdef BRAID_X86
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
#else
  return false;
#endif
}

inline bool cpu_has_vnni() {
#ifdef BRAID_X86
  return cpu_has_avx512() && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

// "auto" (everything this CPU has), "avx512-vnni", "avx512", "avx2" or "scalar", less what
// this CPU lacks (an unknown name is an error).
inline Isa isa_named(const std::string& name) {
  const bool all = name == "auto" || name == "avx512-vnni";
  if (!all && name != "avx512" && name != "avx2" && name != "scalar")
    throw std::invalid_argument("unknown ISA " + name +
                                ": expected auto, avx512-vnni, avx512, avx2 or scalar");
  Isa isa;
  isa.avx2 = name != "scalar" && cpu_has_avx2();
  isa.avx512 = (all || name == "avx512") && cpu_has_avx512();
  isa.vnni = all && cpu_has_vnni();
  return isa;
}

// The most capable set `isa` holds, by the names isa_named takes.
inline std::string isa_name(const Isa& isa) {
  return isa.vnni ? "avx512-vnni" : isa.avx512 ? "avx512" : isa.avx2 ? "avx2" : "scalar";
}

}  // namespace braid_kernels
