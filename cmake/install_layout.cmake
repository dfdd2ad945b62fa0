# Where `cmake --install` puts each part (relative to the prefix), and how the
# installed binaries find each other and torch.
#
# A plain install (`cmake --install build --prefix P`): P/lib, P/include,
# P/bin/optimize-model, P/lib/cmake/torchfuse, and the Python package in
# P/lib/pythonX.Y/site-packages/torchfuse (TORCHFUSE_INSTALL_PYTHONDIR).
#
# A wheel (`pip install .`: scikit-build-core sets SKBUILD, and the prefix is
# site-packages): the Python package in torchfuse/, and inside it lib/,
# include/, bin/optimize-model and lib/cmake/torchfuse; the environment's
# bin/optimize-model is tools/optimize_model/launcher.py.
if(SKBUILD)
  set(CMAKE_INSTALL_LIBDIR torchfuse/lib)
  set(CMAKE_INSTALL_INCLUDEDIR torchfuse/include)
  set(CMAKE_INSTALL_BINDIR torchfuse/bin)
  set(TORCHFUSE_INSTALL_PYTHONDIR .)
  # NB: a wheel stores a symlink as a copy of its target: libtorchfuse_ops.so,
  # .so.0 and .so.0.1.0 would be three copies of the library.
  set(TORCHFUSE_SOVERSION_PROPERTIES)
else()
  set(TORCHFUSE_INSTALL_PYTHONDIR
    "lib/python${Python3_VERSION_MAJOR}.${Python3_VERSION_MINOR}/site-packages"
    CACHE STRING "Where cmake --install puts the torchfuse Python package, relative to the prefix")
  set(TORCHFUSE_SOVERSION_PROPERTIES
    VERSION ${PROJECT_VERSION} SOVERSION ${PROJECT_VERSION_MAJOR})
endif()
include(GNUInstallDirs)

# _torchfuse_relative(<var> <from> <to>): the path from one install directory
# to another, both relative to the prefix ("" when they are the same).
function(_torchfuse_relative var from to)
  cmake_path(SET _from NORMALIZE "/${from}")
  cmake_path(SET _to NORMALIZE "/${to}")
  file(RELATIVE_PATH _rel "${_from}" "${_to}")
  string(REGEX REPLACE "/$" "" _rel "${_rel}")
  set(${var} "${_rel}" PARENT_SCOPE)
endfunction()

# The directories of torch's own RPATH, relative to its lib/
# ($ORIGIN/../../nvidia/cu13/lib), that hold the CUDA libraries
# libtorchfuse_ops links too (cuBLASLt, cuDNN, the runtime): where a torch wheel
# keeps them.
set(_torchfuse_torch_deps "")
if(EXISTS "${TORCH_INSTALL_PREFIX}/lib/libtorch_cuda.so")
  file(READ_ELF "${TORCH_INSTALL_PREFIX}/lib/libtorch_cuda.so" RPATH _rpath RUNPATH _runpath)
  foreach(_entry IN LISTS _rpath _runpath)
    if(_entry MATCHES "^\\$ORIGIN/(.+)$")
      file(GLOB _libs "${TORCH_INSTALL_PREFIX}/lib/${CMAKE_MATCH_1}/libcublasLt.so*"
                      "${TORCH_INSTALL_PREFIX}/lib/${CMAKE_MATCH_1}/libcudart.so*"
                      "${TORCH_INSTALL_PREFIX}/lib/${CMAKE_MATCH_1}/libcudnn.so*")
      if(_libs)
        list(APPEND _torchfuse_torch_deps "${CMAKE_MATCH_1}")
      endif()
    endif()
  endforeach()
endif()
# NB: isolated builds (pip, python -m build) compile against a torch in the
# temporary directory, deleted after the build; and a world-writable
# directory is no place for an RPATH.
set(_torchfuse_torch_is_temporary FALSE)
foreach(_tmp "$ENV{TMPDIR}" /tmp /var/tmp)
  if(_tmp)
    cmake_path(IS_PREFIX _tmp "${TORCH_INSTALL_PREFIX}" NORMALIZE _under)
    if(_under)
      set(_torchfuse_torch_is_temporary TRUE)
    endif()
  endif()
endforeach()

# torchfuse_install_rpath(<var> <dir>): the INSTALL_RPATH of a binary
# installed in <dir> (relative to the prefix): the torchfuse libraries through
# $ORIGIN, then torch's libraries (and its CUDA libraries, as torch finds
# them).
#
# A wheel looks for torch beside it in site-packages first, where pip puts
# it; then, as a plain install does, where the torch it was built against
# is (a --no-build-isolation build, for an environment whose torch lives in
# another environment's site-packages).  Python loads torch before _C in any
# case, and the optimize-model launcher puts Python's torch on
# LD_LIBRARY_PATH.
function(torchfuse_install_rpath var dir)
  _torchfuse_relative(_to_lib "${dir}" "${CMAKE_INSTALL_LIBDIR}")
  if(_to_lib)
    set(_rpath "$ORIGIN/${_to_lib}")
  else()
    set(_rpath "$ORIGIN")
  endif()
  if(SKBUILD)
    foreach(_torch_dir . ${_torchfuse_torch_deps})
      cmake_path(SET _target NORMALIZE "torch/lib/${_torch_dir}")
      _torchfuse_relative(_rel "${dir}" "${_target}")
      list(APPEND _rpath "$ORIGIN/${_rel}")
    endforeach()
  endif()
  if(NOT SKBUILD OR NOT _torchfuse_torch_is_temporary)
    list(APPEND _rpath "${TORCH_INSTALL_PREFIX}/lib")
    foreach(_torch_dir ${_torchfuse_torch_deps})
      cmake_path(SET _target NORMALIZE "${TORCH_INSTALL_PREFIX}/lib/${_torch_dir}")
      if(IS_DIRECTORY "${_target}")
        list(APPEND _rpath "${_target}")
      endif()
    endforeach()
  endif()
  list(REMOVE_DUPLICATES _rpath)
  set(${var} "${_rpath}" PARENT_SCOPE)
endfunction()
