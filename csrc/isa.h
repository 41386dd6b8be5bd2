// mlxserve: choosing, at run time, the instruction-set build of a kernel.
//
// Each kernel file is compiled once per instruction set into its own namespace
// (isa_baseline; isa_x86_v3 with AVX2/FMA on x86-64). MLXSERVE_PICK_ISA(fn)
// names the build of fn this CPU runs.

#pragma once

namespace mlxserve {

// Whether this CPU runs the x86-64-v3 builds (AVX2 and FMA).
inline bool cpu_has_x86_v3() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

}  // namespace mlxserve

#if defined(MLXSERVE_HAVE_X86_V3)
#define MLXSERVE_PICK_ISA(fn) \
  (::mlxserve::cpu_has_x86_v3() ? ::mlxserve::isa_x86_v3::fn : ::mlxserve::isa_baseline::fn)
#define MLXSERVE_ISA_NAME \
  (::mlxserve::cpu_has_x86_v3() ? "x86-64-v3" : MLXSERVE_BASELINE_ISA)
#else
#define MLXSERVE_PICK_ISA(fn) (::mlxserve::isa_baseline::fn)
#define MLXSERVE_ISA_NAME MLXSERVE_BASELINE_ISA
#endif
