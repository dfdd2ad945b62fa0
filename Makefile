# Every target does its own set-up: `make test` and `make demo` work on a fresh
# machine.  tools/setup_python.sh finds or installs torch 2.11.0.
SHELL := /bin/bash
BUILD_DIR ?= build
JOBS ?= $(shell nproc)
CMAKE_ARGS ?=
PYTEST_ARGS ?=

export CCACHE_BASEDIR := $(CURDIR)
export CCACHE_DIR ?= $(HOME)/.cache/torchfuse/ccache
# the wheel build of test/python/test_install.py
export CMAKE_BUILD_PARALLEL_LEVEL ?= $(JOBS)

.PHONY: all setup configure build test test-cpp test-python demo clean

all: build

setup:
	@tools/setup_python.sh $(BUILD_DIR) >/dev/null

configure: setup
	@cmake -S . -B $(BUILD_DIR) -DPython3_EXECUTABLE="$$(cat $(BUILD_DIR)/python-path)" $(CMAKE_ARGS) >/dev/null

build: configure
	@cmake --build $(BUILD_DIR) -j $(JOBS)

test: build
	@tools/run_tests.sh $(BUILD_DIR)

test-cpp: build
	@tools/run_tests.sh $(BUILD_DIR) cpp

test-python: build
	@tools/run_tests.sh $(BUILD_DIR) python

demo: build
	@source ./env.sh && python examples/demo.py

clean:
	rm -rf $(BUILD_DIR)
