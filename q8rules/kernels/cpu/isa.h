// Which SIMD path a native call runs: the best this CPU has, capped by $Q8RULES_CPU_ISA. Every
// kernel asks here, so one variable moves them all and one report names what ran.
//
// Each architecture has a ladder of paths, lowest first, and a cap picks a rung of it:
//   x86-64:  scalar < avx2 (AVX2 + FMA + F16C) < avx512 (AVX-512 F; the Q8_0-activation
//            product's int8 dots use VNNI where the CPU has it, else AVX2's)
//   aarch64: scalar < neon (Advanced SIMD, baseline) < neon_dotprod (ARMv8.2 sdot)
// The codes are fixed across architectures (the Python side names them by code); a name from
// the other architecture's ladder, or any other word, is refused with the names that are valid.

#ifndef Q8RULES_ISA_H_
#define Q8RULES_ISA_H_

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#include "simd.h"  // Q8_X86, Q8_ARM

#if Q8_ARM && defined(__linux__)
#include <sys/auxv.h>
#endif

namespace q8isa {

enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kNeon = 3, kNeonDot = 4 };
inline constexpr const char* kNames[] = {"scalar", "avx2", "avx512", "neon", "neon_dotprod"};
inline constexpr int kCount = 5;

// This architecture's paths, lowest first, and the words $Q8RULES_CPU_ISA takes.
#if Q8_X86
inline constexpr Isa kLadder[] = {kScalar, kAvx2, kAvx512};
inline constexpr const char* kChoices = "avx512, avx2, scalar or auto";
#elif Q8_ARM
inline constexpr Isa kLadder[] = {kScalar, kNeon, kNeonDot};
inline constexpr const char* kChoices = "neon_dotprod, neon, scalar or auto";
#else
inline constexpr Isa kLadder[] = {kScalar};
inline constexpr const char* kChoices = "scalar or auto";
#endif
inline constexpr int kRungs = sizeof kLadder / sizeof kLadder[0];

// Set through Q8GemvForceScalar: tests run the scalar path on a SIMD CPU.
inline std::atomic<bool> g_force_scalar{false};

// The rung of `isa` on this architecture's ladder, -1 when it is not on it.
inline int Rung(Isa isa) {
  for (int i = 0; i < kRungs; ++i)
    if (kLadder[i] == isa) return i;
  return -1;
}

#if Q8_ARM
// ARMv8.2's int8 dot product (sdot), from the kernel's hardware capabilities (Linux), else from
// the compiler's target (a build for a CPU that has it).
inline bool HasDotProd() {
#if defined(__linux__) && defined(HWCAP_ASIMDDP)
  static const bool has = (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
  return has;
#elif defined(__ARM_FEATURE_DOTPROD)
  return true;
#else
  return false;
#endif
}
#endif

// The best path this CPU supports.
inline Isa Best() {
#if Q8_X86
  static const Isa best = [] {
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
          __builtin_cpu_supports("f16c")))
      return kScalar;
    return __builtin_cpu_supports("avx512f") ? kAvx512 : kAvx2;
  }();
  return best;
#elif Q8_ARM
  return HasDotProd() ? kNeonDot : kNeon;
#else
  return kScalar;
#endif
}

// The path a call runs: $Q8RULES_CPU_ISA (a name on this architecture's ladder; unset, empty or
// "auto": the best), capped at what the CPU supports, and scalar while g_force_scalar is on.
// Read on every call. False for a word that is not on the ladder.
inline bool Select(Isa* isa) {
  int want = kRungs - 1;
  const char* env = std::getenv("Q8RULES_CPU_ISA");
  if (env != nullptr && *env != '\0' && std::strcmp(env, "auto") != 0) {
    want = -1;
    for (int i = 0; i < kRungs; ++i)
      if (std::strcmp(env, kNames[kLadder[i]]) == 0) want = i;
    if (want < 0) return false;
  }
  if (g_force_scalar.load(std::memory_order_relaxed)) want = 0;
  const int best = Rung(Best());
  *isa = kLadder[want < best ? want : best];
  return true;
}

// The error a kernel gives for a $Q8RULES_CPU_ISA that Select refuses, prefixed by its name.
inline std::string BadEnv(const char* kernel) {
  return std::string(kernel) + ": $Q8RULES_CPU_ISA must be " + kChoices;
}

}  // namespace q8isa

#endif  // Q8RULES_ISA_H_
