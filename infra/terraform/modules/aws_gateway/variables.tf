variable "name_prefix" {
  description = "Deployment name, prefixed to every resource name."
  type        = string
  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,14}$", var.name_prefix))
    error_message = "name_prefix: 2-15 characters, lowercase letters, digits and '-', starting with a letter."
  }
}

variable "region" {
  description = "AWS region of the gateway, its database and its load balancer."
  type        = string
  validation {
    condition     = can(regex("^[a-z]{2}(-gov)?-[a-z]+-[0-9]$", var.region))
    error_message = "region must be an AWS region name such as us-east-1."
  }
}

variable "vpc_id" {
  description = "VPC of the gateway (modules/aws_network with private subnets)."
  type        = string
}

variable "public_subnet_ids" {
  description = "Public subnets, one per zone, for the load balancer."
  type        = list(string)
  validation {
    condition     = length(var.public_subnet_ids) >= 2
    error_message = "public_subnet_ids: an application load balancer needs subnets in at least two zones."
  }
}

variable "private_subnet_ids" {
  description = "Private subnets, one per zone, for the gateway tasks, the database and the predictor file system."
  type        = list(string)
  validation {
    condition     = length(var.private_subnet_ids) >= 2
    error_message = "private_subnet_ids: the database needs subnets in at least two zones."
  }
}

variable "kms_key_arn" {
  description = "KMS key (in var.region) for the database, secrets, file system and logs."
  type        = string
  validation {
    condition     = can(regex("^arn:aws[a-z-]*:kms:", var.kms_key_arn))
    error_message = "kms_key_arn must be a KMS key ARN."
  }
}

variable "image" {
  description = "Gateway container image (docker/gateway.Dockerfile), ideally pinned by digest."
  type        = string
  validation {
    condition     = can(regex("^[a-z0-9.-]+(:[0-9]+)?/[a-z0-9._/-]+(:[A-Za-z0-9._-]+|@sha256:[0-9a-f]{64})$", var.image))
    error_message = "image must be a registry reference with a tag or digest, e.g. 123456789012.dkr.ecr.us-east-1.amazonaws.com/fedllm-gateway@sha256:..."
  }
}

variable "trainer_image" {
  description = "Trainer container image (docker/gateway.Dockerfile, --target trainer) of the one-off retraining task, ideally pinned by digest."
  type        = string
  validation {
    condition     = can(regex("^[a-z0-9.-]+(:[0-9]+)?/[a-z0-9._/-]+(:[A-Za-z0-9._-]+|@sha256:[0-9a-f]{64})$", var.trainer_image))
    error_message = "trainer_image must be a registry reference with a tag or digest, e.g. 123456789012.dkr.ecr.us-east-1.amazonaws.com/fedllm-trainer@sha256:..."
  }
}

variable "cpu" {
  description = "Fargate CPU units of the gateway task (1024 = 1 vCPU)."
  type        = number
  validation {
    condition     = contains([1024, 2048, 4096, 8192, 16384], var.cpu)
    error_message = "cpu must be one of 1024, 2048, 4096, 8192, 16384."
  }
}

variable "memory" {
  description = "Memory of the gateway task in MiB (within Fargate's range for var.cpu)."
  type        = number
  validation {
    condition     = var.memory >= 2048 && var.memory <= 122880 && var.memory % 1024 == 0
    error_message = "memory must be a multiple of 1024 between 2048 and 122880."
  }
}

variable "environment" {
  description = "Application environment of the gateway container (GATEWAY_* settings and the FEDLLM_* inputs of docker/gateway-entrypoint.sh); the module adds the database URL and the listen port."
  type        = map(string)
}

variable "domain_name" {
  description = "Public host name of the API, covered by var.certificate_arn."
  type        = string
  validation {
    condition     = can(regex("^([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\\.)+[a-z]{2,}$", var.domain_name))
    error_message = "domain_name must be a DNS name such as llm.example.com."
  }
}

variable "certificate_arn" {
  description = "ACM certificate (in var.region) for var.domain_name."
  type        = string
  validation {
    condition     = can(regex("^arn:aws[a-z-]*:acm:", var.certificate_arn))
    error_message = "certificate_arn must be an ACM certificate ARN."
  }
}

variable "route53_zone_id" {
  description = "Route 53 hosted zone to create var.domain_name in; null if DNS is managed elsewhere (point a CNAME at the load_balancer_dns_name output)."
  type        = string
}

variable "public_cidrs" {
  description = "Who may reach the public API (HTTPS)."
  type        = list(string)
  validation {
    condition     = length(var.public_cidrs) > 0 && alltrue([for c in var.public_cidrs : can(cidrhost(c, 0))])
    error_message = "public_cidrs: at least one IPv4 CIDR."
  }
}

variable "admin_cidrs" {
  description = "The only sources whose requests to /admin and /metrics the load balancer forwards."
  type        = list(string)
  validation {
    condition     = length(var.admin_cidrs) > 0 && length(var.admin_cidrs) <= 4 && alltrue([for c in var.admin_cidrs : can(cidrhost(c, 0)) && c != "0.0.0.0/0"])
    error_message = "admin_cidrs: 1 to 4 CIDRs (a load balancer rule condition's limit), never 0.0.0.0/0."
  }
}

variable "site_cidrs" {
  description = "The sites' fixed addresses (/32): the only destinations of the gateway's gRPC traffic."
  type        = list(string)
}

variable "grpc_port" {
  description = "Port the sites serve gRPC on."
  type        = number
}

variable "tls" {
  description = "The federation CA and the gateway's client certificate and key (PEM)."
  type = object({
    ca_cert_pem     = string
    cert_pem        = string
    private_key_pem = string
  })
  sensitive = true
}

variable "hf_token" {
  description = "Hugging Face token for gated or private tokenizers; null for public ones."
  type        = string
  sensitive   = true
}

variable "database" {
  description = "The gateway's PostgreSQL (RDS) instance."
  type = object({
    instance_class        = string
    engine_version        = string
    allocated_storage_gb  = number
    max_storage_gb        = number
    multi_az              = bool
    backup_retention_days = number
  })
  validation {
    condition     = can(regex("^db\\.", var.database.instance_class)) && can(regex("^1[5-9]", var.database.engine_version)) && var.database.allocated_storage_gb >= 20 && var.database.max_storage_gb >= var.database.allocated_storage_gb && var.database.backup_retention_days >= 1 && var.database.backup_retention_days <= 35
    error_message = "database: instance_class db.*, PostgreSQL 15 or later, at least 20 GB, max_storage_gb >= allocated_storage_gb, 1-35 backup days."
  }
}

variable "drain_seconds" {
  description = "How long a replaced gateway task keeps serving its in-flight requests before it is stopped (load balancer deregistration delay)."
  type        = number
  validation {
    condition     = var.drain_seconds >= 0 && var.drain_seconds <= 3600
    error_message = "drain_seconds must be between 0 and 3600."
  }
}

variable "log_retention_days" {
  description = "Days the gateway's logs are kept."
  type        = number
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
}
