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

variable "region" {
  description = "AWS region of the site, e.g. us-east-1."
  type        = string
  validation {
    condition     = can(regex("^[a-z]{2}(-gov)?-[a-z]+-[0-9]$", var.region))
    error_message = "region must be an AWS region name such as us-east-1."
  }
}

variable "zone" {
  description = "Availability zone of the instances; null picks the first zone of the region that offers the instance type."
  type        = string
  validation {
    condition     = var.zone == null || can(regex("^[a-z]{2}(-gov)?-[a-z]+-[0-9][a-z]$", var.zone))
    error_message = "zone must be an availability zone name such as us-east-1a, or null."
  }
}

variable "instance_type" {
  description = "EC2 GPU instance type, e.g. g6e.xlarge (L40S) or p5.48xlarge (H100)."
  type        = string
  validation {
    condition     = can(regex("^(g[4-9][a-z]*|p[3-9][a-z]*)\\.[0-9a-z]+$", var.instance_type))
    error_message = "instance_type must be an EC2 GPU type (g4dn, g5, g6, g6e, p4d, p5, ...)."
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
  description = "IPv4 range of the site's own VPC."
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

variable "ami_ssm_parameter" {
  description = "Public SSM parameter naming the GPU AMI (NVIDIA driver, Docker, NVIDIA container toolkit)."
  type        = string
  validation {
    condition     = startswith(var.ami_ssm_parameter, "/")
    error_message = "ami_ssm_parameter must be an SSM parameter path."
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

variable "log_retention_days" {
  description = "Days the site VPC's flow logs are kept."
  type        = number
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
}
