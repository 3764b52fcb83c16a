"""The order in which `make test` hands test modules to its workers."""

# The longest modules, longest first (each module's own time over a whole run of `make
# test`: engine starts, most of them); every other module follows in collection order.
LONGEST = ("test_vllm_families", "test_vllm", "test_vllm_pd", "test_workload", "test_vllm_tp",
           "test_vllm_verify", "test_vllm_fleet", "test_cli_cache", "test_fleet_script",
           "test_remote_mooncake", "test_soak", "test_store_properties", "test_processes",
           "test_readme_serve", "test_vllm_events", "test_vllm_window_decode",
           "test_store_state_machine", "test_vllm_router", "test_vllm_remote",
           "test_shared_stress", "test_gpu_worker_check")
