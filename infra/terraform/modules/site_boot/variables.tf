variable "instance_name" {
  description = "The engine's name in the federation (SITE_SITE_NAME); one boot script per instance."
  type        = string
  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{0,62}$", var.instance_name))
    error_message = "instance_name: lowercase letters, digits and '-', starting with a letter, at most 63."
  }
}

variable "model" {
  description = "The served model: its name at the gateway and where its weights come from (a Hugging Face repository at a pinned revision)."
  type = object({
    name        = string
    hf_repo     = string
    hf_revision = string
  })
  validation {
    condition     = can(regex("^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$", var.model.hf_repo)) && can(regex("^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$", var.model.hf_revision))
    error_message = "model.hf_repo must be 'owner/name'; model.hf_revision a commit hash (recommended), tag or branch."
  }
}

variable "image" {
  description = "Site engine container image (docker/site.Dockerfile), ideally pinned by digest."
  type        = string
  validation {
    condition     = can(regex("^[a-z0-9.-]+(:[0-9]+)?/[a-z0-9._/-]+(:[A-Za-z0-9._-]+|@sha256:[0-9a-f]{64})$", var.image))
    error_message = "image must be a registry reference with a tag or digest, e.g. ghcr.io/acme/fedllm-site@sha256:..."
  }
}

variable "grpc_port" {
  description = "Host port the site engine's gRPC service is published on."
  type        = number
  validation {
    condition     = var.grpc_port >= 1024 && var.grpc_port <= 65535
    error_message = "grpc_port must be between 1024 and 65535."
  }
}

variable "settings" {
  description = "Extra SITE_* settings of the engine (site_engine/settings.py), e.g. SITE_MAX_NUM_SEQS."
  type        = map(string)
  validation {
    condition     = alltrue([for key, value in var.settings : can(regex("^SITE_[A-Z0-9_]+$", key)) && !startswith(key, "SITE_TLS_") && !can(regex("[\n\r'\"]", value))])
    error_message = "settings: keys are SITE_* names other than SITE_TLS_* (set from the secret bundle); values are single-line and contain no quotes."
  }
}

variable "fetch_bundle" {
  description = "Shell commands that print this instance's secret bundle (JSON: ca_pem, cert_pem, key_pem, hf_token) from its cloud's secret manager, using the instance's own identity."
  type        = string
  validation {
    condition     = length(trimspace(var.fetch_bundle)) > 0
    error_message = "fetch_bundle must not be empty."
  }
}
