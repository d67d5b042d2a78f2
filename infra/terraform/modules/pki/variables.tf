variable "name_prefix" {
  description = "Deployment name, used as the organization of every certificate."
  type        = string
  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,14}$", var.name_prefix))
    error_message = "name_prefix: 2-15 characters, lowercase letters, digits and '-', starting with a letter."
  }
}

variable "ca_validity_days" {
  description = "Lifetime of the private CA that signs the gateway's and the sites' certificates."
  type        = number
  validation {
    condition     = var.ca_validity_days >= 365 && var.ca_validity_days <= 3650
    error_message = "ca_validity_days must be between 365 and 3650."
  }
}

variable "leaf_validity_days" {
  description = "Lifetime of the gateway's client certificate (sites' server certificates use the same in their modules); it is re-issued on the first apply in the last 30 days."
  type        = number
  validation {
    condition     = var.leaf_validity_days >= 60 && var.leaf_validity_days <= 825
    error_message = "leaf_validity_days must be between 60 and 825."
  }
}
