// Built by nvcc: the same inline function and ops as steps_cpp.cpp.
#include "steps.hpp"

StepResults steps_cu(ptrain::Device device) { return run_steps(device); }
