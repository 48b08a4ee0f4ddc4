# cmake -DBINARY=<program> [-DEXPECT_CUDA=ON] -P check_no_cuda_deps.cmake
#
# Fails when the dynamic dependencies of BINARY (as ldd lists them) include the
# CUDA runtime, cuBLAS or NCCL: a CPU program of a CUDA-enabled build must run
# where none of them is installed (they come only with ptrain::cuda). With
# EXPECT_CUDA=ON it checks the opposite, that a program linked with ptrain::cuda
# does list libcudart, so the check itself can be seen to work.
if(NOT BINARY OR NOT EXISTS "${BINARY}")
  message(FATAL_ERROR "check_no_cuda_deps: BINARY '${BINARY}' does not exist")
endif()
find_program(LDD ldd REQUIRED)
execute_process(COMMAND ${LDD} ${BINARY} OUTPUT_VARIABLE deps RESULT_VARIABLE rc ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "check_no_cuda_deps: ldd ${BINARY} failed (${rc}): ${err}")
endif()
string(REGEX MATCHALL "lib(cudart|cublas|cublasLt|nccl)[^ \t\n]*" cuda_deps "${deps}")
list(REMOVE_DUPLICATES cuda_deps)
get_filename_component(name ${BINARY} NAME)
if(EXPECT_CUDA)
  if(NOT cuda_deps MATCHES "libcudart")
    message(FATAL_ERROR "${name} links ptrain::cuda but ldd lists no libcudart:\n${deps}")
  endif()
  message(STATUS "${name} depends on: ${cuda_deps}")
elseif(cuda_deps)
  message(FATAL_ERROR "${name} is a CPU program but depends on ${cuda_deps}; the CUDA link lines belong "
                      "to ptrain::cuda, not ptrain::ptrain")
else()
  message(STATUS "${name} needs no CUDA library")
endif()
