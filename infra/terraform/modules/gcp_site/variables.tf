variable "name" {
  description = "The site's name in the site map; prefixes every resource of the site."
  type        = string
  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{0,40}$", var.name))
    error_message = "name: lowercase letters, digits and '-', starting with a letter, at most 41."
  }
}

variable "name_prefix" {
  description = "Deployment name, prefixed to resource names that must be unique in the account."
  type        = string
  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,14}$", var.name_prefix))
    error_message = "name_prefix: 2-15 characters, lowercase letters, digits and '-', starting with a letter."
  }
}

variable "instance_names" {
  description = "Federation names of the site's engines: one instance each."
  type        = list(string)
  validation {
    condition     = length(var.instance_names) >= 1 && alltrue([for n in var.instance_names : can(regex("^[a-z][a-z0-9-]{0,62}$", n))])
    error_message = "instance_names: at least one; lowercase letters, digits and '-'."
  }
}

variable "model" {
  description = "The served model: name at the gateway, Hugging Face repository and revision of its weights."
  type = object({
    name        = string
    hf_repo     = string
    hf_revision = string
  })
}

variable "image" {
  description = "Site engine container image (docker/site.Dockerfile)."
  type        = string
}

variable "settings" {
  description = "Extra SITE_* settings of the engines."
  type        = map(string)
}

variable "grpc_port" {
  description = "Port the engines serve gRPC on."
  type        = number
}

variable "gateway_cidrs" {
  description = "The only sources admitted to the gRPC port: the gateway's egress addresses."
  type        = list(string)
  validation {
    condition     = length(var.gateway_cidrs) > 0 && alltrue([for c in var.gateway_cidrs : can(cidrhost(c, 0)) && c != "0.0.0.0/0"])
    error_message = "gateway_cidrs: at least one CIDR, never 0.0.0.0/0."
  }
}

variable "disk_gb" {
  description = "Root volume size: the OS image, the container image and the model weights."
  type        = number
  validation {
    condition     = var.disk_gb >= 100 && var.disk_gb <= 16000
    error_message = "disk_gb must be between 100 and 16000."
  }
}

variable "tls_ca_cert_pem" {
  description = "The federation CA certificate."
  type        = string
}

variable "tls_ca_private_key_pem" {
  description = "The federation CA private key, to sign the engines' server certificates."
  type        = string
  sensitive   = true
}

variable "tls_validity_days" {
  description = "Lifetime of the engines' server certificates."
  type        = number
}

variable "hf_token" {
  description = "Hugging Face token for gated or private weights; null for public ones."
  type        = string
  sensitive   = true
}

variable "project" {
  description = "GCP project of the site."
  type        = string
  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{4,28}[a-z0-9]$", var.project))
    error_message = "project must be a GCP project ID."
  }
}

variable "region" {
  description = "GCP region of the site, e.g. europe-west4."
  type        = string
  validation {
    condition     = can(regex("^[a-z]+-[a-z]+[0-9]$", var.region))
    error_message = "region must be a GCP region name such as europe-west4."
  }
}

variable "zone" {
  description = "Zone of the instances (GPUs are zonal), inside var.region, e.g. europe-west4-a."
  type        = string
  validation {
    condition     = can(regex("^[a-z]+-[a-z]+[0-9]-[a-z]$", var.zone))
    error_message = "zone must be a GCP zone name such as europe-west4-a."
  }
}

variable "machine_type" {
  description = "Accelerator-optimized machine type with its GPUs attached, e.g. g2-standard-8 (L4), a2-highgpu-1g (A100), a3-highgpu-8g (H100)."
  type        = string
  validation {
    condition     = can(regex("^(a2|a3|a4|g2|g4)-[a-z0-9-]+$", var.machine_type))
    error_message = "machine_type must be an accelerator-optimized type (a2, a3, a4, g2, g4 families)."
  }
}

variable "subnet_cidr" {
  description = "IPv4 range of the site's subnet in its own VPC network."
  type        = string
  validation {
    condition     = can(cidrhost(var.subnet_cidr, 0))
    error_message = "subnet_cidr must be an IPv4 CIDR."
  }
}

variable "boot_image" {
  description = "Boot image with the NVIDIA driver, e.g. a Deep Learning VM image family."
  type        = string
}

variable "boot_disk_type" {
  description = "Boot disk type the machine type supports (pd-balanced; hyperdisk-balanced for a3-ultra and a4)."
  type        = string
  validation {
    condition     = contains(["pd-balanced", "pd-ssd", "hyperdisk-balanced"], var.boot_disk_type)
    error_message = "boot_disk_type must be pd-balanced, pd-ssd or hyperdisk-balanced."
  }
}

variable "labels" {
  description = "Labels added to every resource that takes them."
  type        = map(string)
}
