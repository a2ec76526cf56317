// The logits llama.cpp computes for a GGUF file at every position of a token sequence,
// teacher-forced (each position sees the sequence's own tokens before it, whatever the model
// would have picked), as one JSON object on stdout: what `tests/gguf.rs` compares the engine
// with. One token per decode call: llama.cpp's batched quantized matrix products (AMX on this
// machine) are not what is being compared, and one of them crashes here.
//
// Build against a llama.cpp build tree (see docs/notes/llama-cpp-side-by-side.md, recipe):
//   g++ -O2 -std=c++17 llama_logits.cpp -I $LLAMA/include -I $LLAMA/ggml/include \
//     $BUILD/src/libllama.a $BUILD/ggml/src/libggml.a $BUILD/ggml/src/libggml-cpu.a \
//     $BUILD/ggml/src/libggml-base.a -fopenmp -lpthread -ldl -o llama_logits
// Usage: llama_logits MODEL.gguf TOKEN,TOKEN,... [THREADS]

#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

static void quiet(ggml_log_level, const char *, void *) {}

int main(int argc, char ** argv) {
    if (argc < 3) {
        std::fprintf(stderr, "usage: %s MODEL.gguf TOKEN,TOKEN,... [THREADS]\n", argv[0]);
        return 2;
    }
    std::vector<llama_token> tokens;
    std::string list = argv[2];
    for (size_t start = 0; start <= list.size();) {
        size_t end = list.find(',', start);
        if (end == std::string::npos) {
            end = list.size();
        }
        tokens.push_back(std::atoi(list.substr(start, end - start).c_str()));
        start = end + 1;
    }
    const int threads = argc > 3 ? std::atoi(argv[3]) : 1;

    llama_log_set(quiet, nullptr);
    llama_backend_init();
    llama_model_params model_params = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(argv[1], model_params);
    if (model == nullptr) {
        std::fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }
    llama_context_params context_params = llama_context_default_params();
    context_params.n_ctx = tokens.size() + 16;
    context_params.n_threads = threads;
    context_params.n_threads_batch = threads;
    llama_context * context = llama_init_from_model(model, context_params);
    if (context == nullptr) {
        std::fprintf(stderr, "cannot make a context\n");
        return 1;
    }
    const int vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

    std::printf("{\"tokens\": [");
    for (size_t i = 0; i < tokens.size(); i++) {
        std::printf("%s%d", i ? ", " : "", tokens[i]);
    }
    std::printf("], \"logits\": [");
    for (size_t i = 0; i < tokens.size(); i++) {
        if (llama_decode(context, llama_batch_get_one(&tokens[i], 1)) != 0) {
            std::fprintf(stderr, "decode failed at position %zu\n", i);
            return 1;
        }
        const float * logits = llama_get_logits_ith(context, -1);
        std::printf("%s[", i ? ", " : "");
        for (int v = 0; v < vocab; v++) {
            // Nine significant digits give back the exact binary32.
            std::printf("%s%.9g", v ? ", " : "", logits[v]);
        }
        std::printf("]");
    }
    std::printf("]}\n");
    llama_free(context);
    llama_model_free(model);
    return 0;
}
