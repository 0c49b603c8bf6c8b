// The Python module of the fused CPU kernels (see runtime/kernels/__init__.py for why and when they serve).

#include <torch/extension.h>

#include "activation.h"
#include "amx.h"
#include "argmax.h"
#include "attention.h"
#include "decode_layer.h"
#include "decode_stack.h"
#include "grids.h"
#include "ledger.h"
#include "norms.h"
#include "quant.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using swa::Projection;
  m.def("rms_norm", &swa::rms_norm, "RMSNorm of rows, optionally added to a residual");
  m.def("qk_norm_rope", &swa::qk_norm_rope, "per-head RMSNorm then rotary embedding");
  m.def("gelu_and_mul", &swa::gelu_and_mul, "GELU (tanh) of the gate half times the up half of (T, 2I) rows");
  m.def("decode_attention", &swa::decode_attention, "one query per request over keys read in place");
  m.def("extend_attention", &swa::extend_attention, "the new tokens of an extend over the keys each one sees");
  m.def("extend_tiles", &swa::extend_tiles, "the tiles extend attention runs on: amx, bfloat16, float32 or none");
  m.def("set_extend_tiles", &swa::set_extend_tiles, pybind11::arg("name"),
        "extend attention's tiles: auto (the fastest here), none, float32, bfloat16 or amx; returns the previous name");
  m.def("amx_attention_on", &swa::amx_attention_on, "whether extend attention's tiles run on AMX-BF16 here");
  m.def("row_argmax", &swa::row_argmax, "each row's largest value and the first index of it (NaN if any)");
  m.def("write_kv", &swa::write_kv, "k_buf[loc] = k and v_buf[loc] = v, row by row");
  m.def("writes_owned", &swa::writes_owned, "whether a forward's KV writes are in order against the ownership ledger");
  m.def("has_low_bit", [] { return swa::kHasLowBit; }, "whether the low-bit kernels were built (AVX512-VNNI or AVX2)");
  m.def("low_bit_isa", [] { return std::string(swa::kLowBitIsa); },
        "the instructions the low-bit kernels run on: avx512_vnni, avx2, or empty (none built)");
  m.attr("MAX_ROWS") = swa::kMaxRows;
  m.attr("PAIR_BUDGET") = swa::kPairBudget;
  m.attr("NARROW_MAX") = swa::kNarrowMax;
  m.def("int8_block_grid", &swa::int8_block_grid, pybind11::arg("weight"), pybind11::arg("units"),
        pybind11::arg("tolerance"),
        "(q int8, step per block of 32) with weight == q * step, step a float16 value, or None (grids.h)");
  m.def("int4_grid", &swa::int4_grid, pybind11::arg("weight"), pybind11::arg("tolerance"),
        "(q int32 in 0..15, step, low per group of 32) with weight == low + step * q, or None (grids.h)");
  m.def("coarse_int4", &swa::coarse_int4, pybind11::arg("weight"),
        "(q int32 in 0..15, step, low per group of 32): each group rounded to 16 levels from its minimum to its maximum");
  m.def("weight_arena", &swa::weight_arena, pybind11::arg("nbytes"), pybind11::arg("huge_pages") = true,
        "a uint8 buffer aligned to 2 MB, in 2 MB pages where huge_pages (a hint to the kernel)");
  // module_local: two builds of these kernels in one process (a benchmark holding an older one) must not clash over
  // the type's name.
  pybind11::class_<Projection>(m, "Projection", pybind11::module_local(), "a weight in a low-bit decode kernel's packed layout")
      .def_static("int8", &Projection::int8,
                  "int8 (N, K) and float32 scales (N,) or (N, K/32): W = q * scale per row or per block of 32")
      .def_static("int8_wide", &Projection::int8_wide, pybind11::arg("q"), pybind11::arg("scales"),
                  pybind11::arg("smooth") = pybind11::none(),
                  "int8 (N, K) and float32 scales (N, K/128): W = q * scale per block of 128, activations in blocks of "
                  "128 too; smooth (K,) positive: q * scale holds W * smooth, the activations are divided by it")
      .def_static("int4", &Projection::int4, pybind11::arg("q"), pybind11::arg("step"), pybind11::arg("low"),
                  pybind11::arg("half_scales") = false,
                  "q (N, K) in 0..15, step and low (N, K/32): W = low + step * q; half_scales keeps step and low in "
                  "float16 (a screen's coarse copy)")
      .def("matmul", &Projection::matmul, pybind11::arg("x"), pybind11::arg("float_out") = false,
           "x (M, K) times the weight's transpose, up to 8 rows streamed, more in tiles: (M, N) in x's dtype, or float32")
      .def("set_tiles", &Projection::set_tiles, pybind11::arg("tiles"),
           "a copy of this weight (same shape) that takes the rows past MAX_ROWS from now on")
      .def("drop_tiles", &Projection::drop_tiles, "every row count on this copy again")
      .def_property_readonly("has_tiles", &Projection::has_tiles)
      .def_property_readonly("smoothed", &Projection::smoothed, "whether it or its tiles' copy divides the activations by a smooth")
      .def("refine", &Projection::refine, pybind11::arg("x"), pybind11::arg("y"), pybind11::arg("margin"),
           "y (M, N) float32, a screen's approximate x @ W^T: each group of 16 columns with a value within margin of "
           "its row's largest recomputed as matmul computes it, in place; returns how many groups")
      .def_property_readonly("out_features", &Projection::out_features)
      .def_property_readonly("in_features", &Projection::in_features)
      .def_property_readonly("nbytes", &Projection::nbytes)
      .def_property_readonly("placed_bytes", &Projection::placed_bytes, "bytes `place` takes in an arena")
      .def("place", &Projection::place, pybind11::arg("arena"), pybind11::arg("offset"), pybind11::arg("huge_pages"),
           "moves the streamed weights and scales into arena[offset:] (64-byte aligned); returns the offset past them; "
           "huge_pages: the arena is in 2 MB pages")
      .def_property_readonly("huge_pages", &Projection::huge_pages, "placed in an arena of 2 MB pages")
      .def_property_readonly("paired", &Projection::paired,
                             "int8 in blocks of 128 whose four weights per 16-bit sum of the AVX2 tiles add up to at "
                             "most PAIR_BUDGET in magnitude (those tiles then take two lines a step)")
      .def_property_readonly("narrow", &Projection::narrow,
                             "int8 per block of 32 whose weights lie within -NARROW_MAX..NARROW_MAX (a GGUF's Q5_0): "
                             "the AVX2 kernels then add four lines' products in 16 bits before widening them")
      .def_property_readonly("format", [](const Projection& p) {
        switch (p.format()) {
          case swa::Format::kInt8: return "int8";
          case swa::Format::kInt8Block: return "int8-block";
          case swa::Format::kInt4Half: return "int4-half";
          case swa::Format::kInt8Wide: return "int8-wide";
          default: return "int4";
        }
      });
  m.def("layer_pre", &swa::layer_pre, "a decoder layer before its attention: q, k, v");
  m.def("layer_post", &swa::layer_post, "a decoder layer after its attention: its output");
  pybind11::class_<swa::StackLayer>(m, "StackLayer", pybind11::module_local(), "one decoder layer's fixed parts")
      .def(pybind11::init([](Projection qkv, Projection o, Projection gate_up, Projection down, at::Tensor input_scale,
                             at::Tensor post_attn_scale, at::Tensor pre_ff_scale, at::Tensor post_ff_scale,
                             at::Tensor qk_scale, int64_t heads, int64_t kv_heads, int64_t rope, double eps,
                             double scaling, double softcap, std::vector<at::Tensor> watched,
                             std::vector<int64_t> versions) {
             return swa::StackLayer{qkv, o, gate_up, down, input_scale, post_attn_scale, pre_ff_scale, post_ff_scale,
                                    qk_scale, heads, kv_heads, rope, eps, scaling, softcap, watched, versions};
           }),
           pybind11::arg("qkv"), pybind11::arg("o"), pybind11::arg("gate_up"), pybind11::arg("down"),
           pybind11::arg("input_scale"), pybind11::arg("post_attn_scale"), pybind11::arg("pre_ff_scale"),
           pybind11::arg("post_ff_scale"), pybind11::arg("qk_scale"), pybind11::arg("heads"),
           pybind11::arg("kv_heads"), pybind11::arg("rope"), pybind11::arg("eps"), pybind11::arg("scaling"),
           pybind11::arg("softcap"), pybind11::arg("watched"), pybind11::arg("versions"));
  pybind11::class_<swa::StackEnds>(m, "StackEnds", pybind11::module_local(), "a model's parts around its layers")
      .def(pybind11::init([](at::Tensor embed, at::Tensor embed_scale, at::Tensor final_scale, double eps,
                             std::vector<at::Tensor> watched, std::vector<int64_t> versions) {
             return swa::StackEnds{embed, embed_scale, final_scale, eps, watched, versions};
           }),
           pybind11::arg("embed"), pybind11::arg("embed_scale"), pybind11::arg("final_scale"), pybind11::arg("eps"),
           pybind11::arg("watched"), pybind11::arg("versions"));
  pybind11::class_<swa::DecodeStack>(m, "DecodeStack", pybind11::module_local(), "a model's decoder layers in order")
      .def(pybind11::init<std::vector<swa::StackLayer>, swa::StackEnds>())
      .def("run", &swa::DecodeStack::run,
           "the final norm's rows for the tokens: their embedding, then per layer pre, KV write, attention, post")
      .def("current", &swa::DecodeStack::current, "every watched tensor at the version and data it was made from")
      .def("__len__", &swa::DecodeStack::size);
}
