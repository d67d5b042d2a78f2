# The boot script every site instance runs, whatever its cloud: only how the secret bundle is
# fetched differs (var.fetch_bundle). Rendered here once so the three site modules cannot drift.

locals {
  model_dir = "/models/${var.model.name}/${var.model.hf_revision}"
  # Mutual TLS (docs/security.md): the script writes these bundle entries as files into tls_dir,
  # mounted read-only at the same path in the container, and the engine reads them through the
  # SITE_TLS_* settings. The client CA is the federation CA, which signs the gateway's client
  # certificate, and also this engine's own certificate, which the container's health probe
  # presents (site_engine/healthcheck.py).
  tls_dir = "/etc/fedllm/tls"
  tls_files = {
    SITE_TLS_CERT      = { bundle_key = "cert_pem", file = "cert.pem" }
    SITE_TLS_KEY       = { bundle_key = "key_pem", file = "key.pem" }
    SITE_TLS_CLIENT_CA = { bundle_key = "ca_pem", file = "ca.pem" }
  }
  # Non-secret container environment; the Dockerfile sets host, port, device and dtype defaults.
  environment = merge(var.settings, {
    SITE_SITE_NAME     = var.instance_name
    SITE_MODEL_NAME    = var.model.name
    SITE_MODEL_DIR     = local.model_dir
    FEDLLM_HF_REPO     = var.model.hf_repo
    FEDLLM_HF_REVISION = var.model.hf_revision
  }, { for setting, tls in local.tls_files : setting => "${local.tls_dir}/${tls.file}" })
  script = templatefile("${path.module}/boot.sh.tftpl", {
    instance_name = var.instance_name
    image         = var.image
    grpc_port     = var.grpc_port
    env_lines     = join("\n", [for key in sort(keys(local.environment)) : "${key}=${local.environment[key]}"])
    fetch_bundle  = var.fetch_bundle
    tls_dir       = local.tls_dir
    tls_files     = jsonencode({ for tls in values(local.tls_files) : tls.bundle_key => tls.file })
  })
}
