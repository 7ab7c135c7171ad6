#pragma once
#include <ATen/ATen.h>
#include <gtest/gtest.h>
