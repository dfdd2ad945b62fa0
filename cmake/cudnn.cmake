# cuDNN for kernels/cudnn/ (the graph API's runtime fusion): the headers and
# the library of the cuDNN torch itself loads (the nvidia-cudnn wheel beside a
# torch wheel, else the CUDA toolkit's), and the header-only cudnn-frontend at
# a pinned version, fetched from the package registry into the torchfuse cache
# (tools/fetch_cudnn_frontend.py) unless TORCHFUSE_CUDNN_FRONTEND_INCLUDE_DIR
# names a copy.  Sets TORCHFUSE_CUDNN_INCLUDE_DIRS and TORCHFUSE_CUDNN_LIBRARIES.

set(TORCHFUSE_CUDNN_FRONTEND_VERSION 1.16.0)
set(TORCHFUSE_CUDNN_FRONTEND_INCLUDE_DIR "" CACHE PATH
  "cudnn-frontend's include/ directory (holding cudnn_frontend.h); empty: nvidia-cudnn-frontend==${TORCHFUSE_CUDNN_FRONTEND_VERSION} fetched from the package registry")

if(NOT TORCHFUSE_CUDNN_FRONTEND_INCLUDE_DIR)
  if(DEFINED ENV{TORCHFUSE_CACHE_DIR})
    set(_cache "$ENV{TORCHFUSE_CACHE_DIR}")
  elseif(DEFINED ENV{XDG_CACHE_HOME})
    set(_cache "$ENV{XDG_CACHE_HOME}/torchfuse")
  else()
    set(_cache "$ENV{HOME}/.cache/torchfuse")
  endif()
  set(_frontend "${_cache}/cudnn-frontend-${TORCHFUSE_CUDNN_FRONTEND_VERSION}")
  execute_process(
    COMMAND "${Python3_EXECUTABLE}" "${PROJECT_SOURCE_DIR}/tools/fetch_cudnn_frontend.py"
            "${TORCHFUSE_CUDNN_FRONTEND_VERSION}" "${_frontend}"
    RESULT_VARIABLE _rc ERROR_VARIABLE _err)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "torchfuse: the CUDA kernels need cudnn-frontend ${TORCHFUSE_CUDNN_FRONTEND_VERSION}: ${_err}")
  endif()
  set(_frontend_include "${_frontend}/include")
else()
  set(_frontend_include "${TORCHFUSE_CUDNN_FRONTEND_INCLUDE_DIR}")
endif()
if(NOT EXISTS "${_frontend_include}/cudnn_frontend.h")
  message(FATAL_ERROR "torchfuse: no cudnn_frontend.h in ${_frontend_include} (TORCHFUSE_CUDNN_FRONTEND_INCLUDE_DIR)")
endif()

cmake_path(SET _wheel_cudnn NORMALIZE "${TORCH_INSTALL_PREFIX}/../nvidia/cudnn")
find_path(TORCHFUSE_CUDNN_INCLUDE_DIR cudnn.h
  HINTS "${_wheel_cudnn}/include" ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include)
find_library(TORCHFUSE_CUDNN_LIBRARY NAMES libcudnn.so.9 cudnn
  HINTS "${_wheel_cudnn}/lib" ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda/lib64)
if(NOT TORCHFUSE_CUDNN_INCLUDE_DIR OR NOT TORCHFUSE_CUDNN_LIBRARY)
  message(FATAL_ERROR "torchfuse: cuDNN not found (cudnn.h: ${TORCHFUSE_CUDNN_INCLUDE_DIR}, "
    "library: ${TORCHFUSE_CUDNN_LIBRARY}); torch's own nvidia-cudnn wheel provides both")
endif()
message(STATUS "torchfuse: cuDNN ${TORCHFUSE_CUDNN_LIBRARY}, cudnn-frontend ${_frontend_include}")

set(TORCHFUSE_CUDNN_INCLUDE_DIRS "${TORCHFUSE_CUDNN_INCLUDE_DIR}" "${_frontend_include}")
set(TORCHFUSE_CUDNN_LIBRARIES "${TORCHFUSE_CUDNN_LIBRARY}")
