"""The build of torch_kvcanary._C (`build_ext`) and the CUDA toolkit finder (`cuda_toolkit`)."""
