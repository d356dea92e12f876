/* TEST-ONLY fake CUDA driver (libcuda.so.1) for exercising kvikio's host-memory path on a
 * machine without an NVIDIA driver (see ../shared/design/io-stack-facts.md §1).
 *
 * Every entry point answers CUDA_ERROR_NOT_INITIALIZED (3), which kvikio's is_host_memory()
 * treats as "host memory", so CuFile.pread/pwrite work on numpy buffers in compat mode.
 * cuInit answers CUDA_ERROR_NO_DEVICE (100), so FlatCake's probe never mistakes it for a
 * real driver. Built by tests/shim/loader.py into a temporary directory and put on
 * LD_LIBRARY_PATH of a test SUBPROCESS only. It never ships in the package and must never
 * be visible on a machine with a real driver.
 *
 * Build: gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o libcuda.so.1 fake_libcuda.c
 */
#define NI(name) int name(void) { return 3; }   /* CUDA_ERROR_NOT_INITIALIZED */
int cuDriverGetVersion(int *v) { if (v) *v = 12090; return 0; }
int cuGetErrorName(int e, const char **s) { (void)e; if (s) *s = "CUDA_ERROR_NOT_INITIALIZED (fake libcuda)"; return 0; }
int cuGetErrorString(int e, const char **s) { return cuGetErrorName(e, s); }
int cuDeviceGetCount(int *n) { if (n) *n = 0; return 3; }
int cuInit(unsigned f) { (void)f; return 100; }
NI(cuCtxCreate_v2) NI(cuCtxCreate_v4) NI(cuCtxDestroy_v2) NI(cuCtxGetCurrent) NI(cuCtxGetDevice)
NI(cuCtxPopCurrent_v2) NI(cuCtxPushCurrent_v2) NI(cuDeviceGet) NI(cuDeviceGetAttribute)
NI(cuDevicePrimaryCtxRelease_v2) NI(cuDevicePrimaryCtxRetain) NI(cuEventCreate) NI(cuEventDestroy_v2)
NI(cuEventQuery) NI(cuEventRecord) NI(cuEventSynchronize) NI(cuLaunchHostFunc) NI(cuMemFreeHost)
NI(cuMemGetAddressRange_v2) NI(cuMemHostAlloc) NI(cuMemHostRegister_v2) NI(cuMemHostUnregister)
NI(cuMemcpyAsync) NI(cuMemcpyBatchAsync) NI(cuMemcpyBatchAsync_v2) NI(cuMemcpyDtoHAsync_v2)
NI(cuMemcpyHtoDAsync_v2) NI(cuPointerGetAttribute) NI(cuPointerGetAttributes) NI(cuStreamCreate)
NI(cuStreamDestroy_v2) NI(cuStreamSynchronize)
