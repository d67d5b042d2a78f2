variable "name" {
  description = "Alias of the key (alias/<name>) and its description."
  type        = string
  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,60}$", var.name))
    error_message = "name: 2-61 characters, lowercase letters, digits and '-', starting with a letter."
  }
}

variable "region" {
  description = "AWS region of the key (KMS keys are regional: one per region that encrypts data)."
  type        = string
  validation {
    condition     = can(regex("^[a-z]{2}(-gov)?-[a-z]+-[0-9]$", var.region))
    error_message = "region must be an AWS region name such as us-east-1."
  }
}

variable "tags" {
  description = "Tags added to the key."
  type        = map(string)
}
