// A oneDNN-reordered linear weight rebuilt over bytes already in memory (engine/checkpoints/weights_cache.py
// maps them from a file): no copy and no reorder. oneDNN's blocked layout is described by a
// serialized memory descriptor, which torch hands out for a reordered weight
// (torch.ops.mkldnn._get_mkldnn_serialized_md) and takes back here; AOTInductor loads its
// frozen CPU constants the same way. The tensor returned does not own its bytes: the caller
// keeps `data` alive as long as the weight.

#include <ATen/ATen.h>
#include <torch/library.h>

namespace at::native {
// Defined in ATen/native/mkldnn/MKLDNNCommon.cpp and exported by libtorch_cpu; its header is
// not among the ones the wheel ships.
TORCH_API at::Tensor mkldnn_tensor_from_data_ptr(void* data_ptr, at::IntArrayRef dims,
                                                 at::ScalarType dtype, at::Device device,
                                                 const uint8_t* opaque_metadata,
                                                 int64_t opaque_metadata_size);
}  // namespace at::native

namespace {

at::Tensor packed_weight_from_bytes(const at::Tensor& data, at::IntArrayRef sizes,
                                    at::ScalarType dtype, const at::Tensor& descriptor) {
  TORCH_CHECK(data.scalar_type() == at::kByte && data.is_contiguous(),
              "packed_weight_from_bytes: data must be contiguous uint8");
  TORCH_CHECK(descriptor.scalar_type() == at::kByte && descriptor.is_contiguous(),
              "packed_weight_from_bytes: descriptor must be contiguous uint8");
  int64_t elements = 1;
  for (int64_t size : sizes) elements *= size;
  // A blocked layout pads, never shrinks: fewer bytes than the plain matrix is a bad entry.
  TORCH_CHECK(data.numel() >= elements * static_cast<int64_t>(c10::elementSize(dtype)),
              "packed_weight_from_bytes: ", data.numel(), " bytes for ", elements, " elements");
  at::Tensor weight = at::native::mkldnn_tensor_from_data_ptr(
      data.data_ptr(), sizes, dtype, data.device(), descriptor.data_ptr<uint8_t>(),
      descriptor.numel());
  TORCH_CHECK(static_cast<int64_t>(weight.sizes().size()) == static_cast<int64_t>(sizes.size()),
              "packed_weight_from_bytes: the descriptor disagrees with the sizes");
  return weight;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loragate, m) {
  m.def("packed_weight_from_bytes(Tensor data, int[] sizes, ScalarType dtype, Tensor descriptor)"
        " -> Tensor");
}

TORCH_LIBRARY_IMPL(loragate, CPU, m) {
  m.impl("packed_weight_from_bytes", &packed_weight_from_bytes);
}
