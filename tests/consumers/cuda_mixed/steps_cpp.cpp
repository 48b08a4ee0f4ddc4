// Built by the C++ compiler; reaches CUDA through ops:: and ptrain::cuda's table.
#include "steps.hpp"

StepResults steps_cpp(ptrain::Device device) { return run_steps(device); }
