# A relocated GCC whose own search path (-B<its lib dir>) holds libstdc++.a but
# not libstdc++.so links parts of the C++ runtime into every shared library:
# a private copy beside the libstdc++.so.6 that torch loads.  Streams and
# locales then cross the two copies, and an error message that formats a
# number dies with SIGSEGV.  With such a compiler, link the shared runtime by
# path, ahead of the compiler's own -lstdc++, so that no archive member is
# pulled in.  Sets TORCHFUSE_CXX_RUNTIME (empty when the compiler links the
# shared runtime by itself).
set(TORCHFUSE_CXX_RUNTIME "")
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  execute_process(
    COMMAND ${CMAKE_CXX_COMPILER} -print-file-name=libstdc++.so
    OUTPUT_VARIABLE _tf_stdcxx_so OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT IS_ABSOLUTE "${_tf_stdcxx_so}")
    find_library(TORCHFUSE_SHARED_LIBSTDCXX NAMES libstdc++.so.6 libstdc++.so)
    if(NOT TORCHFUSE_SHARED_LIBSTDCXX)
      message(FATAL_ERROR
        "torchfuse: ${CMAKE_CXX_COMPILER} would link libstdc++ statically into "
        "shared libraries, and no libstdc++.so.6 was found to link instead; set "
        "TORCHFUSE_SHARED_LIBSTDCXX to the libstdc++.so.6 that torch loads")
    endif()
    message(STATUS "torchfuse: ${CMAKE_CXX_COMPILER} finds no libstdc++.so; "
                   "linking ${TORCHFUSE_SHARED_LIBSTDCXX}")
    set(TORCHFUSE_CXX_RUNTIME ${TORCHFUSE_SHARED_LIBSTDCXX})
  endif()
endif()
