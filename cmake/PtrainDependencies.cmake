# Finds ptrain's dependencies and links them to an interface target. Used both
# by the build tree and by the installed ptrainConfig.cmake, so a consumer of
# the installed package gets the same backends the package was built with.
#
# Inputs: PTRAIN_WITH_{BLAS,CUDA,MPI,GLOO,NCCL,SENTENCEPIECE} = ON, OFF or AUTO.
# Outputs: PTRAIN_HAVE_{BLAS,CUDA,MPI,GLOO,NCCL,SENTENCEPIECE} = TRUE/FALSE.

include(CMakeFindDependencyMacro)

# find_dependency returns from the including file on failure, which is what an
# installed config wants; the build tree wants find_package's plain behaviour.
macro(_ptrain_find name)
  if(PTRAIN_FROM_CONFIG)
    find_dependency(${name} ${ARGN})
  else()
    find_package(${name} ${ARGN})
  endif()
endmacro()

_ptrain_find(Eigen3 3.3 REQUIRED NO_MODULE)
_ptrain_find(nlohmann_json 3.9 REQUIRED)
_ptrain_find(ZLIB REQUIRED)
_ptrain_find(Threads REQUIRED)

function(_ptrain_optional var found)
  if(PTRAIN_WITH_${var} STREQUAL "AUTO")
    set(PTRAIN_HAVE_${var} ${found} PARENT_SCOPE)
  elseif(PTRAIN_WITH_${var})
    if(NOT ${found})
      message(FATAL_ERROR "PTRAIN_WITH_${var}=ON but its dependency was not found; "
                          "install it (see tools/install-deps.sh) or set PTRAIN_WITH_${var}=OFF")
    endif()
    set(PTRAIN_HAVE_${var} TRUE PARENT_SCOPE)
  else()
    set(PTRAIN_HAVE_${var} FALSE PARENT_SCOPE)
  endif()
endfunction()

# OpenBLAS for float/double GEMM on the CPU (the BLAS PyTorch uses on Debian);
# Eigen's GEMM is the fallback.
if(PTRAIN_WITH_BLAS STREQUAL "AUTO" OR PTRAIN_WITH_BLAS)
  find_path(PTRAIN_CBLAS_INCLUDE cblas.h PATH_SUFFIXES x86_64-linux-gnu/openblas-pthread openblas-pthread openblas)
  find_library(PTRAIN_OPENBLAS_LIBRARY openblas PATH_SUFFIXES openblas-pthread)
endif()
if(PTRAIN_CBLAS_INCLUDE AND PTRAIN_OPENBLAS_LIBRARY)
  set(_ptrain_blas_found TRUE)
else()
  set(_ptrain_blas_found FALSE)
endif()
_ptrain_optional(BLAS "${_ptrain_blas_found}")

if(PTRAIN_WITH_MPI STREQUAL "AUTO" OR PTRAIN_WITH_MPI)
  find_package(MPI COMPONENTS CXX QUIET)
endif()
_ptrain_optional(MPI "${MPI_CXX_FOUND}")

if(PTRAIN_WITH_GLOO STREQUAL "AUTO" OR PTRAIN_WITH_GLOO)
  find_package(Gloo QUIET)
endif()
_ptrain_optional(GLOO "${Gloo_FOUND}")

if(PTRAIN_WITH_CUDA STREQUAL "AUTO" OR PTRAIN_WITH_CUDA)
  find_package(CUDAToolkit QUIET)
endif()
_ptrain_optional(CUDA "${CUDAToolkit_FOUND}")

set(_ptrain_nccl_found FALSE)
if(PTRAIN_HAVE_CUDA AND (PTRAIN_WITH_NCCL STREQUAL "AUTO" OR PTRAIN_WITH_NCCL))
  find_library(PTRAIN_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR})
  find_path(PTRAIN_NCCL_INCLUDE nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
  if(PTRAIN_NCCL_LIBRARY AND PTRAIN_NCCL_INCLUDE)
    set(_ptrain_nccl_found TRUE)
  endif()
endif()
_ptrain_optional(NCCL "${_ptrain_nccl_found}")

# SentencePiece (Debian's libsentencepiece-dev) reads and runs the tokenizer.model of
# Llama 2, Mistral and other SentencePiece models (data/sentencepiece.hpp): its
# normalizer, unigram and BPE encoders are a protobuf-driven format that only the
# library itself implements exactly.
set(_ptrain_sentencepiece_found FALSE)
if(PTRAIN_WITH_SENTENCEPIECE STREQUAL "AUTO" OR PTRAIN_WITH_SENTENCEPIECE)
  find_package(PkgConfig QUIET)
  if(PkgConfig_FOUND)
    pkg_check_modules(PTRAIN_SENTENCEPIECE QUIET IMPORTED_TARGET GLOBAL sentencepiece)
    set(_ptrain_sentencepiece_found ${PTRAIN_SENTENCEPIECE_FOUND})
  endif()
endif()
_ptrain_optional(SENTENCEPIECE "${_ptrain_sentencepiece_found}")

function(ptrain_link_dependencies target)
  target_link_libraries(${target} INTERFACE Eigen3::Eigen nlohmann_json::nlohmann_json
                                            ZLIB::ZLIB Threads::Threads)
  if(PTRAIN_HAVE_BLAS)
    # SYSTEM: a found directory, not an imported target, would otherwise be a
    # plain -I and cblas.h's warnings would reach every user.
    target_include_directories(${target} SYSTEM INTERFACE ${PTRAIN_CBLAS_INCLUDE})
    target_link_libraries(${target} INTERFACE ${PTRAIN_OPENBLAS_LIBRARY})
    target_compile_definitions(${target} INTERFACE PTRAIN_BLAS=1)
  endif()
  if(PTRAIN_HAVE_MPI)
    target_link_libraries(${target} INTERFACE MPI::MPI_CXX)
    target_compile_definitions(${target} INTERFACE PTRAIN_MPI=1)
  endif()
  if(PTRAIN_HAVE_GLOO)
    target_link_libraries(${target} INTERFACE gloo)
    target_compile_definitions(${target} INTERFACE PTRAIN_GLOO=1)
  endif()
  if(PTRAIN_HAVE_SENTENCEPIECE)
    target_link_libraries(${target} INTERFACE PkgConfig::PTRAIN_SENTENCEPIECE)
    target_compile_definitions(${target} INTERFACE PTRAIN_SENTENCEPIECE=1)
  endif()
  # CUDA and NCCL link lines belong to ptrain::cuda (ptrain_link_cuda_dependencies),
  # so that a CPU program of a CUDA-enabled build needs neither libcudart nor libnccl.
endfunction()

# ptrain::cuda: the CUDA runtime, cuBLAS, cuBLASLt and, when found, NCCL with the
# PTRAIN_NCCL definition (dist/nccl.hpp calls the CUDA runtime, so NCCL comes
# only with the target that brings it).
# ptrain_link_cuda_dependencies(target [scope]): scope INTERFACE (the default) or PUBLIC.
function(ptrain_link_cuda_dependencies target)
  set(scope INTERFACE)
  if(ARGC GREATER 1)
    set(scope ${ARGV1})
  endif()
  target_link_libraries(${target} ${scope} CUDA::cudart CUDA::cublas CUDA::cublasLt)
  if(PTRAIN_HAVE_NCCL)
    target_include_directories(${target} ${scope} ${PTRAIN_NCCL_INCLUDE})
    target_link_libraries(${target} ${scope} ${PTRAIN_NCCL_LIBRARY})
    target_compile_definitions(${target} ${scope} PTRAIN_NCCL=1)
  endif()
endfunction()

message(STATUS "ptrain backends: BLAS=${PTRAIN_HAVE_BLAS} MPI=${PTRAIN_HAVE_MPI} Gloo=${PTRAIN_HAVE_GLOO} "
               "CUDA=${PTRAIN_HAVE_CUDA} NCCL=${PTRAIN_HAVE_NCCL} SentencePiece=${PTRAIN_HAVE_SENTENCEPIECE}")
