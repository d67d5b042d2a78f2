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

variable "vpc_cidr" {
  description = "IPv4 range of the site's own virtual network."
  type        = string
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

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
}

variable "location" {
  description = "Azure region of the site, e.g. swedencentral."
  type        = string
  validation {
    condition     = can(regex("^[a-z]+[a-z0-9]*$", var.location))
    error_message = "location must be an Azure region name such as swedencentral."
  }
}

variable "zone" {
  description = "Availability zone (\"1\", \"2\" or \"3\") of the instances; null where the size has no zonal capacity."
  type        = string
  validation {
    condition     = var.zone == null || contains(["1", "2", "3"], coalesce(var.zone, "1"))
    error_message = "zone must be \"1\", \"2\", \"3\" or null."
  }
}

variable "vm_size" {
  description = "GPU VM size, e.g. Standard_NC24ads_A100_v4 or Standard_NC40ads_H100_v5."
  type        = string
  validation {
    condition     = can(regex("^Standard_N[A-Za-z0-9_]+$", var.vm_size))
    error_message = "vm_size must be an N-series GPU size (Standard_NC..., Standard_ND..., Standard_NV...)."
  }
}

variable "source_image" {
  description = "Marketplace image with the NVIDIA driver, Docker and the NVIDIA container runtime."
  type = object({
    publisher = string
    offer     = string
    sku       = string
    version   = string
  })
}

variable "operator_cidrs" {
  description = "Addresses allowed to the site's Key Vault besides the site itself: where Terraform runs."
  type        = list(string)
  validation {
    condition     = alltrue([for c in var.operator_cidrs : can(cidrhost(c, 0)) && c != "0.0.0.0/0"])
    error_message = "operator_cidrs must be CIDRs, never 0.0.0.0/0."
  }
}
