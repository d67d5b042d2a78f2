# The boot script every site instance runs, whatever its cloud: only how the secret bundle is
# fetched differs (var.fetch_bundle). Rendered here once so the three site modules cannot drift.

locals {
  model_dir = "/models/${var.model.name}/${var.model.hf_revision}"
  # Non-secret container environment; the Dockerfile sets host, port, device and dtype defaults.
  environment = merge(var.settings, {
    SITE_SITE_NAME     = var.instance_name
    SITE_MODEL_NAME    = var.model.name
    SITE_MODEL_DIR     = local.model_dir
    FEDLLM_HF_REPO     = var.model.hf_repo
    FEDLLM_HF_REVISION = var.model.hf_revision
  })
  script = templatefile("${path.module}/boot.sh.tftpl", {
    instance_name = var.instance_name
    image         = var.image
    grpc_port     = var.grpc_port
    env_lines     = join("\n", [for key in sort(keys(local.environment)) : "${key}=${local.environment[key]}"])
    fetch_bundle  = var.fetch_bundle
  })
}
